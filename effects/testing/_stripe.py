"""``FakeStripe``: PaymentIntents and Refunds with Stripe's idempotency, on a local port."""

from __future__ import annotations

import hashlib
import hmac
import json
import queue
import random
import re
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import parse_qsl

import httpx

from ._base import DAY, FakeProvider, Performed
from ._http import Reply, Request

__all__ = ["DEFAULT_DECLINED_CARDS", "FakeStripe"]

MAX_KEY_LENGTH = 255

# Stripe's test payment methods that are declined, with their decline codes.
DEFAULT_DECLINED_CARDS: Mapping[str, str] = {
    "pm_card_chargeDeclined": "generic_decline",
    "pm_card_visa_chargeDeclined": "generic_decline",
    "pm_card_chargeDeclinedInsufficientFunds": "insufficient_funds",
    "pm_card_chargeDeclinedLostCard": "lost_card",
    "pm_card_chargeDeclinedStolenCard": "stolen_card",
    "pm_card_chargeDeclinedFraudulent": "fraudulent",
}
# Stripe's test payment methods that need the customer to authenticate.
AUTHENTICATION_CARDS = frozenset(
    {"pm_card_authenticationRequired", "pm_card_threeDSecure2Required"}
)

_ERROR_TYPES_BY_STATUS = {402: "card_error", 409: "invalid_request_error"}
_DEFAULT_CODES = {402: "card_declined", 409: "idempotency_key_in_use", 429: "rate_limit"}
_NESTED_KEY = re.compile(r"^([^\[\]]+)((?:\[[^\[\]]*\])*)$")

Params = dict[str, Any]
# An operation performs a request that passed its check; a check answers one it refuses.
_Operation = Callable[[Params], Performed]
_Check = Callable[[Params], Reply | None]


class FakeStripe(FakeProvider):
    """A local Stripe API that stripe-python talks to over real HTTP.

    Point a client at it with ``base_addresses={"api": fake.url}`` (``ChargeCard`` and
    ``RefundPayment`` take it as ``base_url``). Form-encoded bodies are read the way
    stripe-python writes them (``metadata[order]=102``).

    - ``POST /v1/payment_intents``: ``amount`` and ``currency`` required; with
      ``confirm=true`` a ``payment_method`` is required and charged at once: status
      ``succeeded``, or 402 ``card_error``/``card_declined`` with the card's
      ``decline_code`` for declined cards (``DEFAULT_DECLINED_CARDS``, ``declined_cards``,
      ``decline_card()``), or for cards needing authentication (e.g.
      ``pm_card_authenticationRequired``) a 402 ``authentication_required`` when
      ``off_session=true`` and status ``requires_action`` otherwise.
    - ``POST /v1/refunds``: ``payment_intent`` required; refunds the remaining amount or
      ``amount``; 400 ``resource_missing``, ``charge_already_refunded`` or
      ``amount_too_large`` as Stripe answers.
    - ``GET /v1/payment_intents/<id>`` and ``GET /v1/refunds/<id>``.
    - ``GET /v1/payment_intents`` (list): newest first, ``created`` (a timestamp or
      ``created[gt|gte|lt|lte]``), ``customer``, ``limit`` (1 to 100, default 10) and
      ``starting_after`` pagination with ``has_more``, read-after-write consistent as
      Stripe's lists are.
    - ``GET /v1/payment_intents/search``: ``query`` clauses joined by ``AND``
      (``metadata['k']:'v'``, ``customer:'cus_x'``, ``status:'succeeded'``), ``limit``
      and ``page``; like Stripe's search it lags: intents younger than
      ``set_search_lag(seconds)`` (0 by default) are not found yet.
    - ``lose_responses(fraction)``: that share of the POSTs that execute are performed
      and their answer lost (the connection closed unanswered): the unknown outcome.
      ``lost_responses`` lists their idempotency keys.
    - ``Authorization: Bearer <key>`` required (401); when ``api_key`` is given, others
      are refused with 401 too (the message never echoes the key).

    Webhooks: with ``webhook_url``, each PaymentIntent that succeeds is announced as a
    ``payment_intent.succeeded`` event, POSTed after the API answer on a thread of its
    own and signed with ``webhook_secret`` (``Stripe-Signature``, verifiable with
    ``stripe.Webhook.construct_event``); an endpoint that does not answer 2xx gets the
    same event (same id) again, up to 4 attempts. ``delivered_events`` and
    ``wait_for_deliveries`` show what was sent; ``send_event`` sends any event.

    Idempotency as Stripe: ``Idempotency-Key`` up to 255 characters; the answer of a
    request that executed (success or card decline alike) is saved for ``retention``
    and replayed with ``Idempotent-Replayed: true``; other parameters or another
    endpoint with the key get 400 ``idempotency_error``; a request while the first is
    in flight gets 409 ``idempotency_key_in_use``. Requests refused by parameter
    checks are not saved. Faults and counters: see ``FakeProvider``; a declined charge
    counts as performed (Stripe did attempt it).

    With ``rate_limit`` (requests per second), requests past it get Stripe's 429:
    ``{"error": {"type": "invalid_request_error", "code": "rate_limit", ...}}`` with
    ``Stripe-Should-Retry: true`` and no ``Retry-After``; ``set_outage()`` answers every
    request 503 (``api_error``).

    Stripe limits each account on its own, and so does ``rate_limit_per_account``
    (requests per second, also ``set_rate_limit_per_account()``): every account gets a
    token bucket of its own holding one second of requests, and a request past its
    account's gets the same 429 ``rate_limit``. The account is the one the request acts
    on: the connected account its ``Stripe-Account`` header names (stripe-python's
    ``stripe_account``, e.g. ``acct_123``), or without one (or with an empty one) the
    platform's own, ``PLATFORM_ACCOUNT``. Both limits may be set: a request is admitted
    only when the server and its account both have room, and one refused spends
    neither's. ``requests_by_account()`` and ``throttled_by_account()`` count per account
    (every request counts, rate limits or not). An account's bucket is made on its first
    request and kept while the fake lives: memory grows with the accounts seen, which a
    test fake can afford.
    """

    _group_limit_name = "rate_limit_per_account"
    PLATFORM_ACCOUNT = "platform"
    """The account a request without ``Stripe-Account`` acts on (not an ``acct_`` id, so
    no connected account is mistaken for it) in the per-account limit and counts."""

    def __init__(
        self,
        *,
        api_key: str | None = None,
        declined_cards: Mapping[str, str] | None = None,
        retention: float = DAY,
        latency: float = 0.0,
        max_stall: float = 60.0,
        webhook_url: str | None = None,
        webhook_secret: str = "whsec_fake_stripe",  # noqa: S107  (a test double's default)
        rate_limit: float | None = None,
        rate_limit_per_account: float | None = None,
    ) -> None:
        """
        :param api_key: The only key accepted (others get 401); None accepts any.
        :param declined_cards: Payment method id to decline code, added to
            ``DEFAULT_DECLINED_CARDS``.
        :param retention: Seconds of the fake's clock an idempotency key is remembered
            (Stripe: 24 hours).
        :param latency: Seconds every request waits before it is handled.
        :param max_stall: The most seconds a held or stalled request waits for its
            release.
        :param webhook_url: Where each succeeded PaymentIntent is announced as a signed
            ``payment_intent.succeeded`` event; None sends none.
        :param webhook_secret: The secret those events are signed with
            (``Stripe-Signature``).
        :param rate_limit: Requests per second past which the answer is 429; None: no
            limit.
        :param rate_limit_per_account: Requests per second for each account; None: no
            limit per account.
        """
        self._api_key = api_key
        self.webhook_url = webhook_url
        self.webhook_secret = webhook_secret
        self._deliveries: queue.Queue[tuple[str, dict[str, Any]] | None] = queue.Queue()
        self._delivered: list[tuple[str, str, int]] = []
        self._delivered_changed = threading.Condition()
        self._sender: threading.Thread | None = None
        self._records_lock = threading.Lock()
        self._declines = {**DEFAULT_DECLINED_CARDS, **(declined_cards or {})}
        self._intents: dict[str, dict[str, Any]] = {}
        self._refunds: dict[str, dict[str, Any]] = {}
        self._lose_fraction = 0.0
        self._lose_rng = random.Random()
        self._lost: list[str | None] = []
        self._search_lag = 0.0
        super().__init__(retention=retention, latency=latency, max_stall=max_stall,
                         rate_limit=rate_limit, group_rate_limit=rate_limit_per_account)

    # -- per-account limits -------------------------------------------------------

    def set_rate_limit_per_account(self, rate: float | None) -> None:
        """Admit at most ``rate`` requests per second for each account (the
        ``Stripe-Account`` header's, else ``PLATFORM_ACCOUNT``), each from a token bucket
        of its own holding one second of requests, full at first (every account's full
        again after this call); the rest get Stripe's 429 ``rate_limit``. Applies with
        ``rate_limit``, not instead. None lifts the limit. ValueError unless ``rate`` is
        a positive number or None."""
        self._set_group_rate_limit(rate)

    def requests_by_account(self) -> dict[str, int]:
        """How many requests arrived per account since ``reset()``, whatever their answer
        (``PLATFORM_ACCOUNT`` for those without ``Stripe-Account``); accounts that sent
        none are absent. The values add up to ``total_requests``."""
        return self._group_counts(throttled=False)

    def throttled_by_account(self) -> dict[str, int]:
        """How many requests were answered 429 by a rate limit (``rate_limit`` or
        ``rate_limit_per_account``) per account since ``reset()``; accounts never refused
        are absent. The values add up to ``throttled``."""
        return self._group_counts(throttled=True)

    def _rate_groups(self, request: Request) -> tuple[str, ...]:
        account = (request.header("Stripe-Account") or "").strip()
        return (account or self.PLATFORM_ACCOUNT,)

    def decline_card(self, payment_method: str, decline_code: str = "generic_decline") -> None:
        """Decline every later charge to ``payment_method`` with ``decline_code``."""
        with self._records_lock:
            self._declines[payment_method] = decline_code

    @property
    def payment_intents(self) -> list[dict[str, Any]]:
        """Every PaymentIntent created, in order, as Stripe's JSON (declined ones too)."""
        with self._records_lock:
            return [dict(intent) for intent in self._intents.values()]

    @property
    def charges(self) -> list[dict[str, Any]]:
        """The PaymentIntents that succeeded: money actually taken."""
        return [intent for intent in self.payment_intents if intent["status"] == "succeeded"]

    @property
    def refunds(self) -> list[dict[str, Any]]:
        """Every Refund created, in order, as Stripe's JSON."""
        with self._records_lock:
            return [dict(refund) for refund in self._refunds.values()]

    # -- webhooks -----------------------------------------------------------------

    @property
    def delivered_events(self) -> list[tuple[str, str, int]]:
        """``(event id, type, HTTP status)`` of each automatic delivery attempt so far
        (status 0: the endpoint could not be reached)."""
        with self._delivered_changed:
            return list(self._delivered)

    def wait_for_deliveries(self, n: int, timeout: float = 10.0) -> None:
        """Block until ``n`` automatic delivery attempts were made; AssertionError after
        ``timeout`` seconds (a test's way to know without sleeping)."""
        with self._delivered_changed:
            if not self._delivered_changed.wait_for(lambda: len(self._delivered) >= n,
                                                    timeout):
                raise AssertionError(f"{len(self._delivered)} of {n} webhook deliveries "
                                     f"after {timeout}s")

    def close(self) -> None:
        """Stop the webhook sender (pending deliveries are dropped), then the server."""
        if self._sender is not None:
            self._deliveries.put(None)
            self._sender.join(30.0)
            self._sender = None
        super().close()

    def _announce(self, event_type: str, data_object: dict[str, Any]) -> None:
        """Queue an event for delivery after the API answer, as Stripe sends webhooks."""
        if self.webhook_url is None:
            return
        if self._sender is None:
            self._sender = threading.Thread(target=self._send_events, daemon=True,
                                            name="fake-stripe-webhooks")
            self._sender.start()
        self._deliveries.put((event_type, dict(data_object)))

    def _send_events(self) -> None:
        while (item := self._deliveries.get()) is not None:
            event_type, data_object = item
            event_id = f"evt_{secrets.token_hex(12)}"
            # Stripe retries an event (same id) until the endpoint answers 2xx.
            for attempt in range(_WEBHOOK_ATTEMPTS):
                try:
                    status = self.send_event(event_type, data_object,
                                             event_id=event_id).status_code
                except httpx.HTTPError:
                    status = 0
                with self._delivered_changed:
                    self._delivered.append((event_id, event_type, status))
                    self._delivered_changed.notify_all()
                if 200 <= status < 300 or self._closing.wait(0.05 * 2**attempt):
                    break

    def send_event(
        self, event_type: str, data_object: Mapping[str, Any], *, event_id: str | None = None
    ) -> httpx.Response:
        """POST a signed Stripe event to ``webhook_url``, as Stripe's webhooks do.

        The body is an ``event`` object (``{"id": "evt_...", "type": event_type, "data":
        {"object": data_object}, ...}``) with a ``Stripe-Signature`` header made with
        ``webhook_secret``. Pass the ``event_id`` of an earlier event to redeliver it, as
        Stripe does when an endpoint did not answer 2xx. Returns the endpoint's answer.
        """
        if self.webhook_url is None:
            raise RuntimeError("FakeStripe(webhook_url=...) is needed to send events")
        event = {
            "id": event_id or f"evt_{secrets.token_hex(12)}",
            "object": "event",
            "api_version": "2024-06-20",
            "created": int(time.time()),
            "type": event_type,
            "livemode": False,
            "pending_webhooks": 1,
            "request": {"id": None, "idempotency_key": None},
            "data": {"object": dict(data_object)},
        }
        body = json.dumps(event).encode()
        headers = {
            "Content-Type": "application/json",
            "Stripe-Signature": stripe_signature(self.webhook_secret, body),
        }
        return httpx.post(self.webhook_url, content=body, headers=headers, timeout=10.0)

    # -- routing ------------------------------------------------------------------

    def _route(self, request: Request) -> Reply | None:
        refusal = self._refusal(request)
        if refusal is not None:
            return refusal
        target = (request.method, request.path.rstrip("/"))
        if target == ("POST", "/v1/payment_intents"):
            return self._post(request, self._create_intent, self._intent_problem)
        if target == ("POST", "/v1/refunds"):
            return self._post(request, self._create_refund, self._refund_problem)
        if request.method == "GET" and (answer := self._get(request)) is not None:
            return answer
        return self._invalid(404, None, f"Unrecognized request URL ({target[0]}: {target[1]}).")

    def _get(self, request: Request) -> Reply | None:
        path = request.path.rstrip("/")
        if path == "/v1/payment_intents":
            return self._list_intents(request)
        if path == "/v1/payment_intents/search":
            return self._search_intents(request)
        found = self._lookup(path)
        return None if found is None else self._ok(found)

    def _refusal(self, request: Request) -> Reply | None:
        authorization = request.header("Authorization") or ""
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return self._invalid(401, None, "You did not provide an API key.")
        if self._api_key is not None and token != self._api_key:
            return self._invalid(401, None, "Invalid API Key provided.")
        key = request.header("Idempotency-Key")
        if key is not None and not 1 <= len(key) <= MAX_KEY_LENGTH:
            message = f"Idempotency keys must be 1 to {MAX_KEY_LENGTH} characters."
            return self._invalid(400, "idempotency_key_invalid", message)
        return None

    def _post(
        self,
        request: Request,
        operation: _Operation,
        problem_of: _Check,
    ) -> Reply | None:
        pairs = parse_qsl(request.body.decode(), keep_blank_values=True)
        params = _nest(pairs)
        problem = problem_of(params)
        if problem is not None:
            return problem
        key = request.header("Idempotency-Key")
        fingerprint = json.dumps([request.method, request.path, sorted(pairs)])
        return self._perform_once(key, fingerprint, lambda: operation(params))

    def _lookup(self, path: str) -> dict[str, Any] | None:
        collection, _, object_id = path.rpartition("/")
        with self._records_lock:
            if collection == "/v1/payment_intents":
                found = self._intents.get(object_id)
            elif collection == "/v1/refunds":
                found = self._refunds.get(object_id)
            else:
                found = None
            return None if found is None else dict(found)

    # -- payment intents ----------------------------------------------------------

    def _intent_problem(self, params: Params) -> Reply | None:
        if _positive_int(params.get("amount")) is None:
            return self._invalid(400, "parameter_invalid_integer", "Invalid amount.", "amount")
        currency = params.get("currency")
        if not isinstance(currency, str) or not re.fullmatch(r"[A-Za-z]{3}", currency):
            return self._invalid(400, "parameter_missing", "Invalid currency.", "currency")
        if _flag(params.get("confirm")) and not params.get("payment_method"):
            message = "A payment method is needed to confirm this PaymentIntent."
            return self._invalid(400, "parameter_missing", message, "payment_method")
        return None

    def _create_intent(self, params: Params) -> Performed:
        intent = self._new_intent(params)
        method = params.get("payment_method")
        confirmed = _flag(params.get("confirm"))
        with self._records_lock:
            decline_code = self._declines.get(method) if isinstance(method, str) else None
        if confirmed and decline_code is not None:
            return self._card_error(intent, "card_declined", decline_code), True
        if confirmed and method in AUTHENTICATION_CARDS:
            if _flag(params.get("off_session")):
                code = "authentication_required"
                return self._card_error(intent, code, code), True
            return self._ok(self._store_intent(intent, "requires_action")), True
        status = "succeeded" if confirmed else _unconfirmed_status(method)
        stored = self._store_intent(intent, status)
        if status == "succeeded":
            stored = self._settle(intent["id"])
        return self._ok(stored), True

    def _new_intent(self, params: Params) -> dict[str, Any]:
        amount = _positive_int(params.get("amount"))
        return {
            "id": f"pi_{secrets.token_hex(12)}",
            "object": "payment_intent",
            "amount": amount,
            "amount_received": 0,
            "amount_refunded": 0,
            "currency": str(params["currency"]).lower(),
            "customer": params.get("customer"),
            "payment_method": params.get("payment_method"),
            "description": params.get("description"),
            "metadata": params.get("metadata") or {},
            "created": int(self.now()),
            "livemode": False,
            "latest_charge": None,
            "last_payment_error": None,
            "status": "requires_payment_method",
        }

    def _store_intent(self, intent: dict[str, Any], status: str) -> dict[str, Any]:
        with self._records_lock:
            intent["status"] = status
            self._intents[intent["id"]] = intent
            return dict(intent)

    def _settle(self, intent_id: str) -> dict[str, Any]:
        settled = self._settle_intent(intent_id)
        self._announce("payment_intent.succeeded", settled)
        return settled

    def _settle_intent(self, intent_id: str) -> dict[str, Any]:
        with self._records_lock:
            intent = self._intents[intent_id]
            intent["amount_received"] = intent["amount"]
            intent["latest_charge"] = f"ch_{secrets.token_hex(12)}"
            return dict(intent)

    def _card_error(self, intent: dict[str, Any], code: str, decline_code: str) -> Reply:
        error = {
            "type": "card_error",
            "code": code,
            "decline_code": decline_code,
            "message": "Your card was declined.",
            "param": "payment_method",
        }
        intent["last_payment_error"] = error
        stored = self._store_intent(intent, "requires_payment_method")
        return self._reply_error(402, {**error, "payment_intent": stored})

    # -- refunds ------------------------------------------------------------------

    def _refund_problem(self, params: Params) -> Reply | None:
        if not isinstance(params.get("payment_intent"), str) or not params["payment_intent"]:
            message = "Missing required param: payment_intent."
            return self._invalid(400, "parameter_missing", message, "payment_intent")
        if "amount" in params and _positive_int(params["amount"]) is None:
            return self._invalid(400, "parameter_invalid_integer", "Invalid amount.", "amount")
        return None

    def _create_refund(self, params: Params) -> Performed:
        intent_id = str(params["payment_intent"])
        with self._records_lock:
            intent = self._intents.get(intent_id)
            if intent is None:
                message = f"No such payment_intent: '{intent_id}'"
                return self._invalid(400, "resource_missing", message, "payment_intent"), True
            refused = self._refund_refusal(intent, params.get("amount"))
            if refused is not None:
                return refused, True
            refund = self._new_refund(intent, params)
            intent["amount_refunded"] += refund["amount"]
            self._refunds[refund["id"]] = refund
            return self._ok(dict(refund)), True

    def _refund_refusal(self, intent: dict[str, Any], amount: object) -> Reply | None:
        """Stripe's answer to a refund it refuses (the caller holds the records lock)."""
        if intent["status"] != "succeeded":
            message = "This PaymentIntent does not have a successful charge to refund."
            return self._invalid(400, "charge_not_refundable", message, "payment_intent")
        remaining = intent["amount"] - intent["amount_refunded"]
        if remaining == 0:
            return self._invalid(400, "charge_already_refunded", "Already fully refunded.")
        if amount is not None and (_positive_int(amount) or 0) > remaining:
            message = "The refund amount is greater than the unrefunded amount."
            return self._invalid(400, "amount_too_large", message, "amount")
        return None

    def _new_refund(self, intent: dict[str, Any], params: Params) -> dict[str, Any]:
        remaining = intent["amount"] - intent["amount_refunded"]
        amount = _positive_int(params.get("amount")) or remaining
        return {
            "id": f"re_{secrets.token_hex(12)}",
            "object": "refund",
            "amount": amount,
            "currency": intent["currency"],
            "payment_intent": intent["id"],
            "charge": intent["latest_charge"],
            "reason": params.get("reason"),
            "metadata": params.get("metadata") or {},
            "status": "succeeded",
            "created": int(self.now()),
        }

    # -- lost answers, lists and search (what reconciliation reads) ---------------

    def lose_responses(self, fraction: float, *, seed: int | None = None) -> None:
        """Perform ``fraction`` (0 to 1) of the POSTs that execute, then close their
        connection unanswered. The answer is still saved under the idempotency key, as
        Stripe saves it, so a retry with the key gets it back."""
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction must be between 0 and 1, got {fraction!r}")
        with self._records_lock:
            self._lose_fraction = fraction
            if seed is not None:
                self._lose_rng.seed(seed)

    @property
    def lost_responses(self) -> list[str | None]:
        """Idempotency keys of the requests performed whose answer was lost."""
        with self._records_lock:
            return list(self._lost)

    def set_search_lag(self, seconds: float) -> None:
        """How long a new PaymentIntent stays invisible to search (Stripe: about a
        minute, up to an hour during an incident); lists are never behind."""
        self._search_lag = seconds

    def _executed(self, key: str | None, performed: Performed) -> Reply | None:
        reply = super()._executed(key, performed)
        if reply is None or not performed[1]:
            return reply
        with self._records_lock:
            lose = self._lose_fraction > 0 and self._lose_rng.random() < self._lose_fraction
            if lose:
                self._lost.append(key)
        return None if lose else reply

    def _list_intents(self, request: Request) -> Reply:
        params = _nest(parse_qsl(request.query, keep_blank_values=True))
        limit = _limit(params.get("limit"))
        if limit is None:
            return self._invalid(400, "parameter_invalid_integer",
                                 "Invalid integer: limit must be between 1 and 100.", "limit")
        created = params.get("created")
        bounds = created if isinstance(created, dict) else (
            {} if created is None else {"gte": created, "lte": created})
        customer = params.get("customer")
        with self._records_lock:
            intents = [dict(i) for i in reversed(self._intents.values())
                       if _created_within(i["created"], bounds)
                       and (customer is None or i["customer"] == customer)]
        after = params.get("starting_after")
        if after is not None:
            ids = [i["id"] for i in intents]
            if after not in ids:
                return self._invalid(400, "resource_missing",
                                     f"No such payment_intent: '{after}'", "starting_after")
            intents = intents[ids.index(after) + 1:]
        return self._ok({"object": "list", "url": "/v1/payment_intents",
                         "has_more": len(intents) > limit, "data": intents[:limit]})

    def _search_intents(self, request: Request) -> Reply:
        params = _nest(parse_qsl(request.query, keep_blank_values=True))
        clauses = _search_clauses(str(params.get("query") or ""))
        if clauses is None:
            return self._invalid(400, "parameter_invalid", "Invalid search query.", "query")
        limit = _limit(params.get("limit"))
        if limit is None:
            return self._invalid(400, "parameter_invalid_integer",
                                 "Invalid integer: limit must be between 1 and 100.", "limit")
        visible_before = self.now() - self._search_lag
        with self._records_lock:
            found = [dict(i) for i in reversed(self._intents.values())
                     if i["created"] <= visible_before
                     and all(_field(i, name) == value for name, value in clauses)]
        start = int(params.get("page") or 0)
        page = found[start:start + limit]
        more = start + limit < len(found)
        return self._ok({"object": "search_result", "url": "/v1/payment_intents/search",
                         "has_more": more, "next_page": str(start + limit) if more else None,
                         "data": page})

    # -- answers ------------------------------------------------------------------

    def _ok(self, document: dict[str, Any]) -> Reply:
        return Reply.json(200, document, self._stripe_headers())

    def _invalid(
        self, status: int, code: str | None, message: str, param: str | None = None
    ) -> Reply:
        error: dict[str, Any] = {"type": "invalid_request_error", "message": message}
        if code is not None:
            error["code"] = code
        if param is not None:
            error["param"] = param
        return self._reply_error(status, error)

    def _reply_error(
        self, status: int, error: dict[str, Any], retry_after: float | None = None
    ) -> Reply:
        headers = self._stripe_headers()
        if retry_after is not None:
            headers += (("Retry-After", str(int(retry_after))),)
        if status == 409:
            headers += (("Stripe-Should-Retry", "true"),)
        return Reply.json(status, {"error": error}, headers)

    def _stripe_headers(self) -> tuple[tuple[str, str], ...]:
        return (("Request-Id", f"req_{secrets.token_hex(7)}"),)

    def _error(
        self, status: int, code: str | None, message: str, retry_after: float | None = None
    ) -> Reply:
        code = code or _DEFAULT_CODES.get(status)
        error: dict[str, Any] = {"type": _error_type(status, code), "message": message}
        if code is not None and code != "idempotency_error":
            error["code"] = code
        if status == 402:
            error["decline_code"] = "generic_decline"
        return self._reply_error(status, error, retry_after)

    def _replayed(self, reply: Reply) -> Reply:
        return reply.with_header("Idempotent-Replayed", "true")

    def _rate_limited(self, limit: float, remaining: int, retry_after: int, reset: int) -> Reply:
        # Stripe's answer past its per-account rate: 429, code rate_limit, no Retry-After,
        # and Stripe-Should-Retry saying a later retry may succeed.
        error = {"type": "invalid_request_error", "code": "rate_limit",
                 "message": "Too many requests hit the API too quickly. We recommend an "
                            "exponential backoff of your requests."}
        return self._reply_error(429, error).with_header("Stripe-Should-Retry", "true")

    def _key_mismatch(self, key: str) -> Reply:
        message = (
            "Keys for idempotent requests can only be used with the same parameters they "
            f"were first used with. Try using a key other than '{key}' if you meant to "
            "execute a different request."
        )
        return self._reply_error(400, {"type": "idempotency_error", "message": message})

    def _key_in_flight(self, key: str) -> Reply:
        message = (
            "There is currently another in-progress request using this idempotency key: "
            f"{key}. Please try again later."
        )
        return self._invalid(409, "idempotency_key_in_use", message)

    def _forget_records(self) -> None:
        with self._records_lock:
            self._intents.clear()
            self._refunds.clear()
            self._declines = dict(DEFAULT_DECLINED_CARDS)


_WEBHOOK_ATTEMPTS = 4


def stripe_signature(secret: str, body: bytes, timestamp: int | None = None) -> str:
    """A ``Stripe-Signature`` header for ``body``: ``t=<time>,v1=<hex HMAC-SHA256>``.

    Stripe signs ``f"{t}.{body}"`` with the endpoint's signing secret (used as is).
    """
    stamp = int(time.time()) if timestamp is None else timestamp
    digest = hmac.new(secret.encode(), f"{stamp}.".encode() + body, hashlib.sha256)
    return f"t={stamp},v1={digest.hexdigest()}"


def _nest(pairs: list[tuple[str, str]]) -> Params:
    """Stripe's form encoding (``metadata[order]=102``) as nested dicts."""
    params: Params = {}
    for name, value in pairs:
        match = _NESTED_KEY.match(name)
        if match is None:
            continue
        path = [match.group(1), *re.findall(r"\[([^\[\]]*)\]", match.group(2))]
        target = params
        for part in path[:-1]:
            child = target.setdefault(part, {})
            if not isinstance(child, dict):
                break
            target = child
        else:
            target[path[-1]] = value
    return params


def _limit(value: object) -> int | None:
    if value is None:
        return 10
    limit = _positive_int(value)
    return limit if limit is not None and limit <= 100 else None


def _created_within(created: int, bounds: Mapping[str, Any]) -> bool:
    checks = {"gt": created.__gt__, "gte": created.__ge__, "lt": created.__lt__,
              "lte": created.__le__}
    return all(checks[op](int(value)) for op, value in bounds.items() if op in checks)


_CLAUSE = re.compile(r"""^(metadata\[(['"])(.+?)\2\]|\w+):(['"])(.*)\4$""")


def _search_clauses(query: str) -> list[tuple[tuple[str, ...], str]] | None:
    """``metadata['k']:'v' AND customer:'c'`` as [(("metadata", "k"), "v"), (("customer",), "c")];
    None for a query this fake cannot read."""
    clauses: list[tuple[tuple[str, ...], str]] = []
    for part in filter(None, (p.strip() for p in query.split(" AND "))):
        match = _CLAUSE.match(part)
        if match is None:
            return None
        name = ("metadata", match[3]) if match[3] is not None else (match[1],)
        clauses.append((name, match[5]))
    return clauses or None


def _field(intent: Mapping[str, Any], name: tuple[str, ...]) -> Any:
    value: Any = intent
    for part in name:
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


def _positive_int(value: object) -> int | None:
    if isinstance(value, int):
        number = value
    elif isinstance(value, str) and value.isdigit():
        number = int(value)
    else:
        return None
    return number if number > 0 else None


def _flag(value: object) -> bool:
    return value in (True, "true")


def _unconfirmed_status(method: object) -> str:
    return "requires_confirmation" if method else "requires_payment_method"


def _error_type(status: int, code: str | None) -> str:
    if code == "idempotency_error":
        return "idempotency_error"
    if status >= 500:
        return "api_error"
    return _ERROR_TYPES_BY_STATUS.get(status, "invalid_request_error")
