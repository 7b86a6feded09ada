"""``payment.charge`` and ``payment.refund`` with the official ``stripe`` library.

Both send the job's key unchanged as Stripe's ``Idempotency-Key`` (never the random one
stripe-python would invent, which would charge twice after a crash). Stripe saves the
first response to a key for at least 24 hours and replays it, errors included, so every
retry and re-claim of a job acts once. The client runs with ``max_network_retries=0``:
the dispatcher is the one retry layer.

Outcome of a call, by what Stripe did::

    PaymentIntent succeeded, processing         done, ledger {"id", "status", "amount",
      or requires_capture                       "currency"}
    PaymentIntent requires_action,              Permanent: a background charge has no
      requires_payment_method, canceled, ...    customer to authenticate; a new attempt
                                                needs a new key
    Refund succeeded, pending, requires_action  done, ledger {"id", "status", "amount",
                                                "currency", "payment_intent"}
    Refund failed or canceled                   Permanent
    402 CardError                               Permanent, with code and decline_code
    400 idempotency_error                       Permanent, logged at ERROR: the key was
                                                reused for another request (a bug)
    409 (idempotency_key_in_use, lock_timeout)  Retry: the first request is in flight
    429 RateLimitError, code rate_limit         Throttled(after=Retry-After): past the
                                                account's rate nothing was done; the effect
                                                pauses for every dispatcher and the
                                                attempt is not counted
    429 other (lock_timeout on one object)      Retry(after=Retry-After)
    500 and other 5xx APIError                  UnknownOutcome: Stripe documents a 500 as
                                                "result unknown"; resending the same key
                                                is safe (it replays or acts once), and
                                                past the window the job goes to reconcile
    401 / 403 (AuthenticationError,             Permanent: configuration, not transient
      PermissionError)
    400 / 404 InvalidRequestError, other 4xx    Permanent, with code and param
    could not connect                           Retry: nothing reached Stripe
    timeout / dropped connection after sending  UnknownOutcome

Stripe errors become outcomes in one place, ``_StripeEffect._call``. HTTP goes through
httpx (``_HttpxTransport``), which hands transport failures to stripe-python as
``APIConnectionError`` with the httpx error kept as ``__cause__``; that is how a refused
connection (Retry) is told apart from a timeout after sending (UnknownOutcome).

Stripe's published limits: a per-account rate of read and write requests per second
(lower in test mode than in live mode; some endpoints have their own), answered past it
with 429 and the error code ``rate_limit``, with ``Stripe-Should-Retry`` saying whether a
later retry may succeed. The limit is the account's, shared by every process using its
keys: declare it with ``ChargeCard(..., limit=outbox.Limit(rate=...))`` or the
dispatcher's ``limits``.

The stripe library's own ``stripe`` logger writes request bodies at DEBUG; keep it at
INFO or above where payloads hold personal data.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, TypeVar

import httpx
import stripe
from pydantic import BaseModel, ConfigDict, Field, field_validator
from stripe.params import PaymentIntentCreateParams, RefundCreateParams

from outbox import (
    ConfigurationError,
    EffectOutcome,
    Job,
    Limit,
    NotPerformed,
    Performed,
    Permanent,
    Retry,
    Throttled,
    UnknownOutcome,
)

from ._http import USER_AGENT, PooledAdapter, never_reached_provider, redact, retry_after
from ._payload import stop_if_told, validated_payload

__all__ = ["ChargeCard", "ChargePayload", "RefundPayload", "RefundPayment"]

log = logging.getLogger("effects.payments")

ResultT = TypeVar("ResultT")

# Stripe's documented metadata limits.
_METADATA_MAX_KEYS = 50
_METADATA_MAX_KEY_LENGTH = 40
_METADATA_MAX_VALUE_LENGTH = 500

# The metadata key every PaymentIntent of ChargeCard carries: the job's key.
KEY_METADATA = "outbox_key"
CLOCK_SKEW = 300.0  # seconds a listing reaches back before the first attempt
LIST_PAGES = 10  # pages of 100 listed before falling back to search
SEARCH_LAG = 3600.0  # seconds after which search's "not found" is trusted

_SETTLED_INTENT_STATUSES = frozenset({"succeeded", "processing", "requires_capture"})
_FAILED_REFUND_STATUSES = frozenset({"failed", "canceled"})


def _check_metadata(metadata: dict[str, str] | None) -> dict[str, str] | None:
    if metadata is None:
        return None
    if len(metadata) > _METADATA_MAX_KEYS:
        raise ValueError(f"takes at most {_METADATA_MAX_KEYS} keys")
    if any(not key or len(key) > _METADATA_MAX_KEY_LENGTH for key in metadata):
        raise ValueError(f"keys must be 1 to {_METADATA_MAX_KEY_LENGTH} characters")
    if any(len(value) > _METADATA_MAX_VALUE_LENGTH for value in metadata.values()):
        raise ValueError(f"values must be at most {_METADATA_MAX_VALUE_LENGTH} characters")
    return metadata


class ChargePayload(BaseModel):
    """PaymentIntent create parameters for a charge confirmed in the same call.

    ``amount`` is in the currency's minor unit (cents), ``currency`` a three-letter ISO
    code (sent lower-case), ``customer`` and ``payment_method`` Stripe ids.
    ``off_session`` (default True) tells Stripe the customer is not present, as is the
    case for a background worker: a card that needs authentication is then declined
    (``authentication_required``) instead of waiting in ``requires_action``.

    :var amount: The amount in the currency's minor unit (4200 is 42.00 EUR), above 0.
    :var currency: A three-letter ISO code, sent lower-case.
    :var customer: The Stripe customer id (``cus_...``).
    :var payment_method: The Stripe payment method id (``pm_...``).
    :var description: Shown in Stripe's dashboard (at most 1000 characters).
    :var metadata: String keys to string values, kept on the PaymentIntent.
    :var off_session: The customer is not present (a background charge).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    amount: int = Field(gt=0, strict=True)
    currency: str = Field(pattern=r"^[A-Za-z]{3}$")
    customer: str = Field(min_length=1)
    payment_method: str = Field(min_length=1)
    description: str | None = Field(default=None, max_length=1000)
    metadata: dict[str, str] | None = None
    off_session: bool = True

    _metadata_limits = field_validator("metadata")(_check_metadata)

    @field_validator("currency")
    @classmethod
    def _lower_case(cls, currency: str) -> str:
        return currency.lower()

    def to_stripe(self) -> PaymentIntentCreateParams:
        """The parameters sent: confirmed at once, redirect-based methods excluded.

        Redirects are excluded because a worker has no browser to send a customer to;
        without that, Stripe would demand a ``return_url``.
        """
        params: PaymentIntentCreateParams = {
            "amount": self.amount,
            "currency": self.currency,
            "customer": self.customer,
            "payment_method": self.payment_method,
            "confirm": True,
            "off_session": self.off_session,
            "automatic_payment_methods": {"enabled": True, "allow_redirects": "never"},
        }
        if self.description is not None:
            params["description"] = self.description
        if self.metadata is not None:
            params["metadata"] = self.metadata
        return params


class RefundPayload(BaseModel):
    """Refund create parameters: ``payment_intent``, optional ``amount`` (minor units;
    the whole remaining amount when absent), ``reason`` and ``metadata``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    payment_intent: str = Field(min_length=1)
    amount: int | None = Field(default=None, gt=0, strict=True)
    reason: Literal["duplicate", "fraudulent", "requested_by_customer"] | None = None
    metadata: dict[str, str] | None = None

    _metadata_limits = field_validator("metadata")(_check_metadata)

    def to_stripe(self) -> RefundCreateParams:
        """The parameters sent to ``POST /v1/refunds``."""
        params: RefundCreateParams = {"payment_intent": self.payment_intent}
        if self.amount is not None:
            params["amount"] = self.amount
        if self.reason is not None:
            params["reason"] = self.reason
        if self.metadata is not None:
            params["metadata"] = self.metadata
        return params


class _HttpxTransport(stripe.HTTPClient):
    """stripe-python's HTTP layer on one shared, closeable ``httpx.Client``.

    Transport failures are handed to stripe-python as ``APIConnectionError`` (its
    contract for HTTP clients) with the httpx error as ``__cause__``, so the adapter can
    tell "never sent" from "sent, no answer".
    """

    name = "outbox-httpx"

    def __init__(self, timeout: float) -> None:
        super().__init__()
        self._client = httpx.Client(timeout=timeout, headers={"User-Agent": USER_AGENT})

    def request(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str] | None,
        post_data: Any = None,
        # Whatever else stripe passes (today its private ``_usage`` telemetry tag) is not
        # ours to read: accepted, unnamed, so a rename in stripe cannot break a charge.
        **_stripe_private: Any,
    ) -> tuple[str, int, Mapping[str, str]]:
        try:
            response = self._client.request(
                method, url, headers=dict(headers or {}), content=post_data
            )
        except httpx.TransportError as exc:
            # stripe-python's error classes have untyped constructors.
            raise stripe.APIConnectionError(  # type: ignore[no-untyped-call]
                f"{type(exc).__name__} while talking to Stripe",
                should_retry=never_reached_provider(exc),
            ) from exc
        return response.text, response.status_code, response.headers

    def close(self) -> None:
        self._client.close()


class _StripeEffect(PooledAdapter):
    """What charges and refunds share: the client, and the one error boundary."""

    def __init__(self, api_key: str, base_url: str | None = None, timeout: float = 30.0,
                 limit: Limit | None = None) -> None:
        """
        :param api_key: The Stripe secret key (``sk_...``), never logged; missing or empty
            raises ``outbox.ConfigurationError``.
        :param base_url: A Stripe-compatible API to call (``FakeStripe().url`` in tests);
            None: Stripe's own.
        :param timeout: Seconds for each request; a read timeout after the request was
            sent is an ``UnknownOutcome``.
        :param limit: The account's rate limit, for every dispatcher running this effect;
            None declares none.
        """
        if not isinstance(api_key, str) or not api_key.strip():
            raise ConfigurationError(
                f"{type(self).__name__} needs a Stripe API key: api_key is missing or empty")
        if limit is not None and not isinstance(limit, Limit):
            raise ConfigurationError(f"limit must be an outbox.Limit, got {limit!r}")
        # The account's rate limit, for every dispatcher running this effect.
        self.limit = limit
        self._api_key = api_key
        self._base_url = base_url
        self._transport = _HttpxTransport(timeout)
        self._stripe = stripe.StripeClient(
            api_key,
            max_network_retries=0,
            base_addresses={"api": base_url} if base_url else None,
            http_client=self._transport,
        )

    def close(self) -> None:
        """Close the HTTP connection pool. The adapter cannot call Stripe afterwards."""
        self._transport.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(base_url={self._base_url!r})"

    def _call(self, job: Job, call: Callable[[stripe.RequestOptions], ResultT]) -> ResultT:
        """Run ``call`` with the job's key as idempotency key; Stripe errors -> outcomes."""
        what = f"{self.name} job {job.key}"
        stop_if_told(job, what)
        try:
            return call({"idempotency_key": job.key})
        except stripe.StripeError as exc:
            outcome = _outcome_of(exc, what, self._api_key)
            _log_outcome(exc, outcome)
            raise outcome from exc


class ChargeCard(_StripeEffect):
    """Charges a saved payment method: one PaymentIntent, created and confirmed at once.

    Guarantees: sends ``job.key`` as Stripe's ``Idempotency-Key`` unchanged, so retries
    and re-claims replay the first PaymentIntent instead of charging again while Stripe
    remembers the key (at least 24 hours). One client per instance, shared by all
    worker threads. The API key never appears in reasons or logs; they carry the job
    key and Stripe ids, never payload contents.

    ``base_url`` overrides Stripe's API base (e.g. ``effects.testing.FakeStripe``);
    ``timeout`` bounds each HTTP call in seconds. Call ``close()`` (or use ``with``) to
    release the connection pool. A missing or empty ``api_key`` raises
    ``outbox.ConfigurationError`` at construction.
    """

    name = "payment.charge"
    payload_model = ChargePayload

    def perform(self, job: Job) -> dict[str, Any]:
        """Create and confirm the PaymentIntent; return its id, status, amount, currency.

        The intent carries the job's key in its metadata (``outbox_key``), which is how
        ``reconcile`` finds it. Raises ``Retry``, ``Permanent`` or ``UnknownOutcome`` as
        drawn in the module docstring.
        """
        charge = validated_payload(ChargePayload, job)
        params = charge.to_stripe()
        params["metadata"] = {**(charge.metadata or {}), KEY_METADATA: job.key}
        intent = self._call(
            job,
            lambda options: self._stripe.v1.payment_intents.create(
                params=params, options=options
            ),
        )
        return _settled_intent(intent, job.key)

    def reconcile(self, job: Job) -> Performed | NotPerformed | None:
        """What became of a charge whose outcome is unknown, from Stripe's own records.

        Lists the customer's PaymentIntents created since the job's first attempt (less
        ``CLOCK_SKEW``), newest first, and looks for the one whose ``outbox_key``
        metadata is the job's key. Stripe's lists are read-after-write consistent, so a
        complete listing without it proves that Stripe never created the intent:
        ``NotPerformed`` (sending the key again cannot charge twice). Found and settled:
        ``Performed`` with the same result ``perform`` returns; found but declined or
        otherwise unsettled: ``Permanent``. Past ``LIST_PAGES`` pages of 100 (a very
        busy customer) the search API is asked instead; it lags (up to an hour during
        an incident), so "not found" there counts only for charges first attempted more
        than ``SEARCH_LAG`` ago, else the answer is None (asked again later). A Stripe
        error propagates: the reconciler counts the pass as unreachable.
        """
        charge = validated_payload(ChargePayload, job)
        since = job.first_attempted_at
        params: dict[str, Any] = {"limit": 100, "customer": charge.customer}
        if since is not None:
            params["created"] = {"gte": int(since.timestamp() - CLOCK_SKEW)}
        intent, complete = self._listed(job.key, params)
        if intent is None and not complete:
            intent, trusted = self._searched(job)
            if intent is None and not trusted:
                return None
        if intent is None:
            log.info("payment.charge job %s: no PaymentIntent carries its key: not performed",
                     job.key)
            return NotPerformed()
        log.info("payment.charge job %s: found PaymentIntent %s (%s)", job.key, intent.id,
                 intent.status)
        declined = _declined(intent)
        if declined is not None:  # the lost answer was a decline: as perform would say
            reason = (f"payment.charge job {job.key}: card declined (found by reconcile: "
                      f"PaymentIntent {intent.id}, {declined})")
            log.warning("%s; giving up", reason)
            raise Permanent(reason)
        return Performed(_settled_intent(intent, job.key))

    def _listed(self, key: str, params: dict[str, Any]) -> tuple[stripe.PaymentIntent | None, bool]:
        """The intent tagged with ``key`` among those listed, and whether the listing
        was complete (every page read)."""
        for _ in range(LIST_PAGES):
            page = self._stripe.v1.payment_intents.list(params=params)  # type: ignore[arg-type]
            for intent in page.data:
                if _tag(intent) == key:
                    return intent, True
            if not page.has_more or not page.data:
                return None, True
            params = {**params, "starting_after": page.data[-1].id}
        return None, False

    def _searched(self, job: Job) -> tuple[stripe.PaymentIntent | None, bool]:
        """The intent tagged with the job's key, by search; and whether a miss can be
        trusted (the charge is older than search's lag)."""
        quoted = job.key.replace("\\", "\\\\").replace("'", "\\'")
        found = self._stripe.v1.payment_intents.search(
            params={"query": f"metadata['{KEY_METADATA}']:'{quoted}'", "limit": 1})
        if found.data:
            return found.data[0], True
        since = job.first_attempted_at
        old_enough = since is not None and (
            datetime.now(UTC) - since).total_seconds() > SEARCH_LAG
        return None, old_enough


class RefundPayment(_StripeEffect):
    """Refunds a PaymentIntent, wholly or in part.

    Guarantees: sends ``job.key`` as Stripe's ``Idempotency-Key`` unchanged, so retries
    and re-claims replay the first refund instead of refunding again while Stripe
    remembers the key. Same client, logging and secrecy rules as ``ChargeCard``.
    """

    name = "payment.refund"
    payload_model = RefundPayload

    def perform(self, job: Job) -> dict[str, Any]:
        """Create the refund; return its id, status, amount, currency and intent id.

        Raises ``Retry``, ``Permanent`` or ``UnknownOutcome`` as drawn in the module
        docstring.
        """
        refund_request = validated_payload(RefundPayload, job)
        refund = self._call(
            job,
            lambda options: self._stripe.v1.refunds.create(
                params=refund_request.to_stripe(), options=options
            ),
        )
        return _settled_refund(refund, job.key)


def _declined(intent: stripe.PaymentIntent) -> str | None:
    """``code=... decline_code=...`` of an intent whose confirmation was declined."""
    error: Any = getattr(intent, "last_payment_error", None)
    if intent.status != "requires_payment_method" or not error:
        return None
    fields = {name: getattr(error, name, None) for name in ("type", "code", "decline_code")}
    return " ".join(f"{name}={value}" for name, value in fields.items() if value)


def _tag(intent: stripe.PaymentIntent) -> str | None:
    """The job key an intent was tagged with (``KEY_METADATA``), if any."""
    metadata: Any = getattr(intent, "metadata", None) or {}
    tag = getattr(metadata, KEY_METADATA, None)  # a StripeObject: fields are attributes
    return tag if isinstance(tag, str) else None


def _settled_intent(intent: stripe.PaymentIntent, key: str) -> dict[str, Any]:
    if intent.status not in _SETTLED_INTENT_STATUSES:
        # Replaying the key would return this same intent: only a new key can try again.
        reason = f"payment.charge job {key}: PaymentIntent {intent.id} is {intent.status}"
        log.warning("%s; giving up", reason)
        raise Permanent(reason)
    log.debug("payment.charge job %s: PaymentIntent %s %s", key, intent.id, intent.status)
    return {
        "id": intent.id,
        "status": intent.status,
        "amount": intent.amount,
        "currency": intent.currency,
    }


def _settled_refund(refund: stripe.Refund, key: str) -> dict[str, Any]:
    if refund.status in _FAILED_REFUND_STATUSES:
        reason = f"payment.refund job {key}: Refund {refund.id} is {refund.status}"
        log.warning("%s; giving up", reason)
        raise Permanent(reason)
    log.debug("payment.refund job %s: Refund %s %s", key, refund.id, refund.status)
    intent = refund.payment_intent
    return {
        "id": refund.id,
        "status": refund.status,
        "amount": refund.amount,
        "currency": refund.currency,
        "payment_intent": intent if isinstance(intent, str) or intent is None else intent.id,
    }


@dataclass(frozen=True)
class _Rule:
    """How one kind of Stripe error is handled."""

    kind: Literal["retry", "permanent", "unknown"]
    label: str
    # Stripe's message is left out where it may echo part of the API key.
    with_detail: bool = True


# Checked in order; the first matching class wins, else the HTTP status decides.
_RULES_BY_TYPE: tuple[tuple[type[stripe.StripeError], _Rule], ...] = (
    (stripe.CardError, _Rule("permanent", "card declined")),
    (stripe.IdempotencyError, _Rule("permanent", "idempotency key reused for another request")),
    (stripe.AuthenticationError, _Rule("permanent", "API key refused", with_detail=False)),
    (stripe.PermissionError, _Rule("permanent", "API key refused", with_detail=False)),
    (stripe.RateLimitError, _Rule("retry", "Stripe asked to wait")),
)
_IN_FLIGHT_OR_BUSY = _Rule("retry", "Stripe asked to wait")
_FAILED = _Rule("unknown", "Stripe failed, result unknown")
_REJECTED = _Rule("permanent", "Stripe rejected the request")


def _outcome_of(exc: stripe.StripeError, what: str, api_key: str) -> EffectOutcome:
    """The outcome for a Stripe error, as tabled in the module docstring."""
    if isinstance(exc, stripe.APIConnectionError):
        return _connection_outcome(exc, what)
    rule = _rule_for(exc)
    reason = f"{what}: {rule.label} (HTTP {exc.http_status}"
    if rule.with_detail:
        reason += f", {_error_detail(exc, api_key)}"
    reason += ")"
    if rule.kind == "retry" and _rate_limited(exc):
        return Throttled(after=_wait(exc), reason=reason)
    if rule.kind == "retry":
        return Retry(reason, after=_wait(exc))
    if rule.kind == "unknown":
        return UnknownOutcome(reason)
    return Permanent(reason)


def _rule_for(exc: stripe.StripeError) -> _Rule:
    for error_type, rule in _RULES_BY_TYPE:
        if isinstance(exc, error_type):
            return rule
    status = exc.http_status
    if status in (409, 429):  # idempotency_key_in_use, lock_timeout, rate limits
        return _IN_FLIGHT_OR_BUSY
    if status is None or status >= 500:
        return _FAILED
    return _REJECTED


def _connection_outcome(exc: stripe.APIConnectionError, what: str) -> EffectOutcome:
    if never_reached_provider(exc.__cause__):
        return Retry(f"{what}: could not connect to Stripe; nothing sent")
    cause = type(exc.__cause__).__name__ if exc.__cause__ else "connection error"
    return UnknownOutcome(f"{what}: {cause} after sending to Stripe; result unknown")


def _error_detail(exc: stripe.StripeError, api_key: str) -> str:
    """``type=... code=... decline_code=... param=...: message``, for a reason."""
    error = _error_body(exc)
    if not error:
        return redact(exc.user_message or "no details", api_key)
    fields = {name: error.get(name) for name in ("type", "code", "decline_code", "param")}
    fields["payment_intent"] = _intent_id(error.get("payment_intent"))
    labels = " ".join(f"{name}={value}" for name, value in fields.items() if value)
    message = error.get("message")
    if isinstance(message, str) and message:
        return f"{labels}: {redact(message, api_key)}"
    return labels or "no details"


def _error_body(exc: stripe.StripeError) -> dict[str, Any]:
    """The ``error`` object of Stripe's JSON answer, as plain JSON ({} when absent)."""
    body = exc.json_body
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, dict) else {}


def _intent_id(intent: object) -> str | None:
    identifier = intent.get("id") if isinstance(intent, dict) else None
    return identifier if isinstance(identifier, str) else None


def _rate_limited(exc: stripe.StripeError) -> bool:
    """Stripe's 429 for the account's rate (code ``rate_limit``), unless Stripe says a
    retry would not help; a 429 ``lock_timeout`` is contention on one object instead."""
    if exc.http_status != 429 or _error_body(exc).get("code") not in ("rate_limit", None):
        return False
    should_retry = (exc.headers or {}).get("Stripe-Should-Retry")
    return should_retry != "false"


def _wait(exc: stripe.StripeError) -> float | None:
    return retry_after(exc.headers) if exc.headers else None


def _log_outcome(exc: stripe.StripeError, outcome: EffectOutcome) -> None:
    if isinstance(exc, stripe.IdempotencyError):
        # Never transient: the same key was enqueued for two different requests.
        log.error("%s; the key must name one request only", outcome)
    elif isinstance(outcome, Permanent):
        log.warning("%s; giving up", outcome)
    elif isinstance(outcome, UnknownOutcome):
        log.warning("%s; will retry with the same key", outcome)
    else:
        log.info("%s; will retry", outcome)
