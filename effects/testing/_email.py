"""``FakeEmailProvider``: Resend's ``POST /emails`` on a local port."""

from __future__ import annotations

import json
import threading
import uuid
from dataclasses import dataclass
from typing import Any

from ._base import DAY, FakeProvider, Performed
from ._http import Reply, Request

__all__ = ["FakeEmailProvider", "SentEmail"]

MAX_KEY_LENGTH = 256
MAX_RECIPIENTS = 50

# The error name Resend gives each status, when a fault does not name one.
_DEFAULT_ERRORS = {
    400: "validation_error",
    401: "missing_api_key",
    403: "invalid_api_key",
    404: "not_found",
    405: "method_not_allowed",
    409: "concurrent_idempotent_requests",
    422: "validation_error",
    429: "rate_limit_exceeded",
}


@dataclass(frozen=True)
class SentEmail:
    """One email the fake sent: its idempotency key, Resend id and JSON body."""

    key: str | None
    id: str
    message: dict[str, Any]
    sent_at: float


class FakeEmailProvider(FakeProvider):
    """A local Resend: ``POST /emails`` over real HTTP, with Resend's idempotency rules.

    - ``Authorization: Bearer <key>`` is required (401 ``missing_api_key``); when
      ``api_key`` is given, any other key gets 403 ``invalid_api_key``, as Resend does.
    - ``Idempotency-Key`` (1 to 256 characters, else 400 ``invalid_idempotency_key``):
      the first request with a key sends the email and its answer is saved for
      ``retention`` (24 h); the same body again replays the answer without sending;
      another body gets 409 ``invalid_idempotent_request``; any request while the first
      is in flight gets 409 ``concurrent_idempotent_requests``.
    - ``from``, ``to`` and ``subject`` are required (422 ``missing_required_field``);
      ``text`` or ``html`` is required and recipients are checked (422
      ``validation_error``). Refused requests are not saved under their key.
    - ``rate_limit`` (Resend's default is 2 requests per second per team): past it,
      429 ``rate_limit_exceeded`` with ``retry-after``, ``ratelimit-limit``,
      ``ratelimit-remaining`` and ``ratelimit-reset`` headers, as Resend answers.

    Errors have Resend's shape: ``{"statusCode": 422, "name": "...", "message": "..."}``.
    Faults and counters: see ``FakeProvider``. ``sent_emails`` lists what was sent.
    """

    def __init__(
        self,
        *,
        api_key: str | None = None,
        retention: float = DAY,
        latency: float = 0.0,
        max_stall: float = 60.0,
        rate_limit: float | None = None,
    ) -> None:
        self._api_key = api_key
        self._sent: list[SentEmail] = []
        self._sent_lock = threading.Lock()
        super().__init__(retention=retention, latency=latency, max_stall=max_stall,
                         rate_limit=rate_limit)

    @property
    def sent_emails(self) -> list[SentEmail]:
        """Every email sent, in order (replays are not sent again)."""
        with self._sent_lock:
            return list(self._sent)

    def _route(self, request: Request) -> Reply | None:
        if request.path.rstrip("/") != "/emails":
            return self._error(404, "not_found", "The requested endpoint does not exist.")
        if request.method != "POST":
            return self._error(405, "method_not_allowed", "Method is not allowed.")
        refusal = self._refusal(request)
        if refusal is not None:
            return refusal
        message = _json_object(request.body)
        if message is None:
            return self._error(400, "validation_error", "The body must be a JSON object.")
        problem = _problem_with(message)
        if problem is not None:
            return self._error(422, *problem)
        key = request.header("Idempotency-Key")
        fingerprint = json.dumps(message, sort_keys=True)
        return self._perform_once(key, fingerprint, lambda: self._send(key, message))

    def _refusal(self, request: Request) -> Reply | None:
        """The answer to a request refused before anything else is looked at."""
        authorization = request.header("Authorization") or ""
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return self._error(401, "missing_api_key", "Missing API key in the header.")
        if self._api_key is not None and token != self._api_key:
            return self._error(403, "invalid_api_key", "API key is invalid.")
        key = request.header("Idempotency-Key")
        if key is not None and not 1 <= len(key) <= MAX_KEY_LENGTH:
            message = f"The key must be between 1-{MAX_KEY_LENGTH} chars."
            return self._error(400, "invalid_idempotency_key", message)
        return None

    def _send(self, key: str | None, message: dict[str, Any]) -> Performed:
        email = SentEmail(key, str(uuid.uuid4()), message, self.now())
        with self._sent_lock:
            self._sent.append(email)
        return Reply.json(200, {"id": email.id}), True

    def _error(
        self, status: int, code: str | None, message: str, retry_after: float | None = None
    ) -> Reply:
        name = code or _DEFAULT_ERRORS.get(status) or _default_name(status)
        headers = () if retry_after is None else (("Retry-After", _seconds(retry_after)),)
        return Reply.json(status, {"statusCode": status, "name": name, "message": message}, headers)

    def _rate_limited(self, limit: float, remaining: int, retry_after: int, reset: int) -> Reply:
        message = (f"Too many requests. You can only make {limit:g} requests per second. "
                   "See rate limit response headers for more information.")
        reply = self._error(429, "rate_limit_exceeded", message, retry_after)
        for name, value in (("ratelimit-limit", f"{limit:g}"),
                            ("ratelimit-remaining", str(remaining)),
                            ("ratelimit-reset", str(reset))):
            reply = reply.with_header(name, value)
        return reply

    def _key_mismatch(self, key: str) -> Reply:
        message = "Same idempotency key used with a different request payload."
        return self._error(409, "invalid_idempotent_request", message)

    def _key_in_flight(self, key: str) -> Reply:
        message = "Same idempotency key used while original request is still in progress."
        return self._error(409, "concurrent_idempotent_requests", message)

    def _forget_records(self) -> None:
        with self._sent_lock:
            self._sent.clear()


def _problem_with(message: dict[str, Any]) -> tuple[str, str] | None:
    """Resend's (error name, message) for a body it would refuse, or None."""
    for field in ("from", "to", "subject"):
        if field not in message:
            return "missing_required_field", f"Missing `{field}` field."
    if not isinstance(message["from"], str) or not message["from"].strip():
        return "validation_error", "Invalid `from` field."
    if not isinstance(message["subject"], str):
        return "validation_error", "Invalid `subject` field."
    for field in ("to", "cc", "bcc", "reply_to"):
        if field in message and not _recipients_ok(message[field]):
            return "validation_error", f"Invalid `{field}` field."
    if not isinstance(message.get("text"), str) and not isinstance(message.get("html"), str):
        return "validation_error", "Give `text` or `html`."
    return None


def _recipients_ok(value: object) -> bool:
    addresses = [value] if isinstance(value, str) else value
    if not isinstance(addresses, list) or not 1 <= len(addresses) <= MAX_RECIPIENTS:
        return False
    return all(isinstance(address, str) and address.strip() for address in addresses)


def _json_object(body: bytes) -> dict[str, Any] | None:
    try:
        document = json.loads(body)
    except ValueError:
        return None
    return document if isinstance(document, dict) else None


def _default_name(status: int) -> str:
    return "internal_server_error" if status >= 500 else "invalid_request"


def _seconds(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)
