"""``email.send``: send one email through Resend's ``POST /emails`` (or a compatible API).

The job's key goes out unchanged as the ``Idempotency-Key`` header. Resend remembers a
key for 24 hours and answers a repeat with the first response instead of sending again,
so every retry and re-claim of the job sends the email once.

Outcome of a call, by what came back::

    2xx                                         done, ledger {"id": <Resend email id>}
    409 concurrent_idempotent_requests          Retry: the first request is in flight
    429, or 503 with Retry-After                Throttled(after=Retry-After, rate from
                                                ratelimit-limit): nothing was sent; the
                                                effect pauses for every dispatcher and the
                                                attempt is not counted
    408, 425                                    Retry(after=Retry-After)
    5xx                                         Retry(after=Retry-After)
    409 invalid_idempotent_request              Permanent: key reused for other content
    any other 4xx, or 1xx/3xx                   Permanent: status, Resend's name, message
    could not connect                           Retry: nothing reached Resend
    timeout / dropped connection after sending  UnknownOutcome: Resend may have sent it

Providers without idempotency keys (Postmark, SES) could only be sent at least once;
this adapter does not pretend otherwise and supports Resend-compatible APIs only.

Resend's published limit: 2 requests per second per team by default (raised on
request), answered past it with 429 ``rate_limit_exceeded`` and the headers
``retry-after``, ``ratelimit-limit``, ``ratelimit-remaining`` and ``ratelimit-reset``.
The limit is the team's, shared by every process sending with its keys: declare it with
``SendEmail(..., limit=outbox.Limit(rate=2.0))`` (or the dispatcher's ``limits``) so
every dispatcher claims within it; without a declared limit the dispatcher learns the
rate from the 429s' ``ratelimit-limit``.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from outbox import ConfigurationError, Job, Limit, Performed, Permanent, Retry

from ._http import USER_AGENT, PooledAdapter, redact, retry_after, send, throttled
from ._payload import stop_if_told, validated_payload

__all__ = ["EmailPayload", "EmailTag", "SendEmail"]

log = logging.getLogger("effects.email")

MAX_RECIPIENTS = 50
# Statuses that say "not now" rather than "never"; 5xx are added by range.
_RETRY_STATUSES = frozenset({408, 425, 429})  # 429 becomes Throttled before
_IN_FLIGHT = "concurrent_idempotent_requests"
LIST_PAGES = 10  # pages of 100 recent sends looked through by reconcile
CLOCK_SKEW = 300.0  # seconds before the first attempt that a send may be dated

Recipients = str | list[str]


class EmailTag(BaseModel):
    """A Resend tag: ``name`` and ``value`` (ASCII letters, digits, ``_`` and ``-``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9_-]+$")
    value: str = Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9_-]+$")


class EmailPayload(BaseModel):
    """The body of Resend's ``POST /emails``, with Resend's own field names.

    ``from`` is spelled ``from_`` in Python (``from`` is a keyword) and ``"from"`` in the
    payload and on the wire. At least one of ``text`` and ``html`` is required; ``to``,
    ``cc``, ``bcc`` and ``reply_to`` take one address or a list. Unknown fields are
    refused, so a typo fails the job at once instead of being dropped silently.

    :var from_: The sender, ``"Name <address>"`` or an address (``"from"`` on the wire).
    :var to: The recipients: one address or a list (at most 50).
    :var subject: The subject line, not empty.
    :var text: The plain-text body (``text`` or ``html`` or both).
    :var html: The HTML body.
    :var cc: Copies: one address or a list.
    :var bcc: Blind copies: one address or a list.
    :var reply_to: Where replies go: one address or a list.
    :var tags: Resend tags (``{"name", "value"}``), for its dashboard and webhooks.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    from_: str = Field(alias="from", min_length=1)
    to: Recipients
    subject: str = Field(min_length=1)
    text: str | None = None
    html: str | None = None
    cc: Recipients | None = None
    bcc: Recipients | None = None
    reply_to: Recipients | None = None
    tags: list[EmailTag] | None = None

    @field_validator("to", "cc", "bcc", "reply_to")
    @classmethod
    def _addresses_present(cls, value: Recipients | None) -> Recipients | None:
        addresses = [value] if isinstance(value, str) else value or []
        if value is not None and not addresses:
            raise ValueError("needs at least one address")
        if len(addresses) > MAX_RECIPIENTS:
            raise ValueError(f"takes at most {MAX_RECIPIENTS} addresses")
        if any(not address.strip() for address in addresses):
            raise ValueError("addresses must not be empty")
        return value

    @model_validator(mode="after")
    def _has_body(self) -> EmailPayload:
        if self.text is None and self.html is None:
            raise ValueError("give `text` or `html` (or both)")
        return self

    def to_resend(self) -> dict[str, Any]:
        """The JSON body Resend expects, without the fields left unset."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class SendEmail(PooledAdapter):
    """Sends ``email.send`` jobs through Resend's ``POST /emails`` over HTTPS.

    Guarantees: sends ``job.key`` as the ``Idempotency-Key`` unchanged, so retries and
    re-claims of a job are deduplicated by the provider and the email goes out once
    while Resend remembers the key (24 hours). One ``httpx.Client`` per instance, shared
    by all worker threads (httpx clients are thread-safe). The API key is sent only in
    the ``Authorization`` header and never appears in reasons or logs; reasons and logs
    carry job keys and email ids, never addresses or content.

    ``base_url`` may point at any Resend-compatible API, such as
    ``effects.testing.FakeEmailProvider``. ``timeout`` (seconds) bounds connect, write
    and read; a read timeout after the request was sent is an ``UnknownOutcome``. Call
    ``close()`` (or use ``with``) to release the connection pool. A missing or empty
    ``api_key`` raises ``outbox.ConfigurationError`` at construction. ``limit`` declares
    the team's rate limit (``outbox.Limit(rate=2.0)`` is Resend's default) for every
    dispatcher running this effect.
    """

    name = "email.send"
    payload_model = EmailPayload

    def __init__(
        self,
        api_key: str,
        base_url: str = "https://api.resend.com",
        timeout: float = 10.0,
        limit: Limit | None = None,
    ) -> None:
        """
        :param api_key: The Resend API key (``re_...``), sent only in the
            ``Authorization`` header; missing or empty raises ``outbox.ConfigurationError``.
        :param base_url: The Resend-compatible API to call (``FakeEmailProvider().url``
            in tests).
        :param timeout: Seconds for each of connect, write and read; a read timeout after
            the request was sent is an ``UnknownOutcome``.
        :param limit: The team's rate limit (``outbox.Limit(rate=2.0)`` is Resend's
            default), for every dispatcher running this effect; None declares none.
        """
        if not isinstance(api_key, str) or not api_key.strip():
            raise ConfigurationError(
                "SendEmail needs a Resend API key: api_key is missing or empty")
        if limit is not None and not isinstance(limit, Limit):
            raise ConfigurationError(f"limit must be an outbox.Limit, got {limit!r}")
        self.limit = limit
        self._api_key = api_key
        self._client = httpx.Client(
            base_url=base_url,
            timeout=timeout,
            headers={"Authorization": f"Bearer {api_key}", "User-Agent": USER_AGENT},
        )

    def perform(self, job: Job) -> dict[str, Any]:
        """Send the job's email; return ``{"id": <email id>}`` for the ledger.

        Raises ``Retry``, ``Permanent`` or ``UnknownOutcome`` as drawn in the module
        docstring.
        """
        email = validated_payload(EmailPayload, job)
        request = self._client.build_request(
            "POST", "/emails", json=email.to_resend(), headers={"Idempotency-Key": job.key}
        )
        stop_if_told(job, f"email job {job.key}")
        response = send(self._client, request, what=f"email job {job.key}")
        return self._outcome(response, job.key)

    def reconcile(self, job: Job) -> Performed | None:
        """What became of an email whose outcome is unknown, where Resend can prove it.

        Resend's ``GET /emails`` lists recent sends (newest first) without idempotency
        keys, and ``GET /emails/{id}`` needs the id a lost answer never returned. So the
        adapter looks through the sends since the job's first attempt (up to
        ``LIST_PAGES`` pages of 100) for one with the job's exact ``from``, ``to`` and
        ``subject``, and reads each such candidate to compare its ``text`` and ``html``:
        an identical email to the same recipients since the first attempt is
        ``Performed`` (``{"id": ...}``, as ``perform`` returns). Otherwise the answer is
        None, never ``NotPerformed``: the list holds only recent sends, so a missing
        email proves nothing, and re-sending past Resend's 24-hour key memory could send
        twice. Such jobs wait in ``reconcile`` for a person (the reconciler asks again
        with backoff, then gives up). An HTTP failure raises: the pass counts as
        unreachable.
        """
        email = validated_payload(EmailPayload, job)
        wanted = email.to_resend()
        since = job.first_attempted_at
        after: str | None = None
        for _ in range(LIST_PAGES):
            page = self._get("/emails", {"limit": 100, **({"after": after} if after else {})})
            sends = page.get("data") or []
            for sent in sends:
                if since is not None and _created(sent) < since.timestamp() - CLOCK_SKEW:
                    return None  # older than the job: nothing further down can be it
                if _same_envelope(sent, wanted) and self._same_body(sent["id"], wanted):
                    log.info("email job %s: found sent as %s", job.key, sent["id"])
                    return Performed({"id": sent["id"]})
            if not page.get("has_more") or not sends:
                return None
            after = sends[-1]["id"]
        return None

    def _get(self, path: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        response = self._client.get(path, params=params)
        response.raise_for_status()
        return _json_object(response)

    def _same_body(self, email_id: str, wanted: dict[str, Any]) -> bool:
        sent = self._get(f"/emails/{email_id}")
        return all(sent.get(part) == wanted.get(part) for part in ("text", "html"))

    def close(self) -> None:
        """Close the HTTP connection pool. The adapter cannot send afterwards."""
        self._client.close()

    def __repr__(self) -> str:
        return f"SendEmail(base_url={str(self._client.base_url)!r})"

    def _outcome(self, response: httpx.Response, key: str) -> dict[str, Any]:
        status = response.status_code
        if response.is_success:
            email_id = _email_id(response)
            log.debug("email job %s sent as %s (HTTP %d)", key, email_id, status)
            return {"id": email_id}
        name, message = _resend_error(response)
        reason = f"email job {key}: Resend answered HTTP {status} {name}"
        if message:
            reason += f": {redact(message, self._api_key)}"
        pushed_back = throttled(status, response.headers, reason)
        if pushed_back is not None:
            log.info("%s; throttled, nothing sent", reason)
            raise pushed_back
        if _is_transient(status, name):
            log.info("%s; will retry", reason)
            raise Retry(reason, after=retry_after(response.headers))
        log.warning("%s; giving up", reason)
        raise Permanent(reason)


def _as_list(value: object) -> list[Any]:
    return [] if value is None else value if isinstance(value, list) else [value]


def _same_envelope(sent: dict[str, Any], wanted: dict[str, Any]) -> bool:
    return (sent.get("from") == wanted.get("from")
            and sent.get("subject") == wanted.get("subject")
            and sorted(_as_list(sent.get("to"))) == sorted(_as_list(wanted.get("to"))))


def _created(sent: dict[str, Any]) -> float:
    try:
        stamp = datetime.fromisoformat(str(sent.get("created_at")).replace(" ", "T"))
    except ValueError:
        return float("inf")  # unreadable: look at it rather than stop the search
    return (stamp if stamp.tzinfo else stamp.replace(tzinfo=UTC)).timestamp()


def _is_transient(status: int, name: str) -> bool:
    if status == 409:
        # The other 409, invalid_idempotent_request, means the key was reused for another
        # email: resending cannot succeed.
        return name == _IN_FLIGHT
    return status in _RETRY_STATUSES or status >= 500


def _email_id(response: httpx.Response) -> str | None:
    body = _json_object(response)
    email_id = body.get("id")
    if isinstance(email_id, str):
        return email_id
    # Resend accepted the email; a missing id does not make it unsent, so the job is done.
    log.warning("Resend accepted an email without returning its id (HTTP %d)", response.status_code)
    return None


def _resend_error(response: httpx.Response) -> tuple[str, str]:
    """Resend's error body is ``{"statusCode": 409, "name": "...", "message": "..."}``."""
    body = _json_object(response)
    name = body.get("name")
    message = body.get("message")
    return (
        name if isinstance(name, str) else "unknown_error",
        message if isinstance(message, str) else "",
    )


def _json_object(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}
