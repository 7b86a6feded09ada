"""``FakeEmailProvider``: Resend's email API (send, batch, get, list, cancel) on a local port."""

from __future__ import annotations

import json
import re
import threading
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parseaddr
from typing import Any
from urllib.parse import parse_qsl

from ._base import DAY, FakeProvider, Performed
from ._http import Reply, Request

__all__ = ["FakeEmailProvider", "SentEmail"]

MAX_KEY_LENGTH = 256
MAX_RECIPIENTS = 50
MAX_BATCH = 100
_EMAIL_PATH = re.compile(r"^/emails/([0-9a-f-]{36})(/cancel)?$")

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
    - ``rate_limit_per_domain`` (also ``set_rate_limit_per_domain()``): each sending
      domain, the lower-cased domain of a send's ``from`` (``"Shop <shop@Example.com>"``
      is ``example.com``), gets a token bucket of its own holding one second of
      requests; a send past its domain's gets the same 429 ``rate_limit_exceeded``, its
      ``ratelimit-limit`` the domain's rate. Applies with ``rate_limit``, not instead: a
      send is admitted only when the server and its domains all have room, and one
      refused spends none of their tokens. A batch is one request to each distinct
      domain among its emails' ``from`` (a batch of 100 emails from one domain takes
      one token, as Resend counts requests, not emails; one from two domains takes one
      from each and is refused whole if either has none). Requests with no domain to
      read (``GET``, cancels, a ``from`` without ``@``, a body that is not JSON) are
      not limited per domain. ``requests_by_domain()`` and ``throttled_by_domain()``
      count per domain. A domain's bucket is made on its first send and kept while the
      fake lives: memory grows with the domains seen, which a test fake can afford.

    Errors have Resend's shape: ``{"statusCode": 422, "name": "...", "message": "..."}``.
    Faults and counters: see ``FakeProvider``. ``sent_emails`` lists what was sent.

    Also, as the official ``resend`` SDK calls them (``resend.api_url = fake.url``):

    - ``POST /emails/batch``: a JSON array of up to 100 emails, all checked before any
      is sent, one ``Idempotency-Key`` for the batch; answers ``{"data": [{"id"}...]}``.
    - ``GET /emails/{id}``: the email object (``object``, ``id``, ``from``, ``to``,
      ``subject``, ``html``, ``text``, ``cc``, ``bcc``, ``reply_to``, ``created_at``,
      ``scheduled_at``, ``last_event``, ``tags``); 404 ``not_found`` for another id.
    - ``GET /emails``: the sends, newest first, ``limit`` (1 to 100, default 20) and
      the ``after`` / ``before`` cursors (an email id), with ``has_more``; like
      Resend's, it has no idempotency keys and no bodies.
    - ``POST /emails/{id}/cancel``: a send with ``scheduled_at`` not yet due becomes
      ``canceled``; any other gets 422 ``validation_error``.
    - Template sends: ``template: {"id", "variables"}`` in place of ``html``/``text``,
      for templates registered with ``add_template`` (422 ``validation_error`` for an
      unknown one); ``{{{NAME}}}`` placeholders are filled from the variables.
    """

    _group_limit_name = "rate_limit_per_domain"

    def __init__(
        self,
        *,
        api_key: str | None = None,
        retention: float = DAY,
        latency: float = 0.0,
        max_stall: float = 60.0,
        rate_limit: float | None = None,
        rate_limit_per_domain: float | None = None,
    ) -> None:
        """
        :param api_key: The only key accepted (others get 403); None accepts any.
        :param retention: Seconds of the fake's clock an idempotency key is remembered
            (Resend: 24 hours).
        :param latency: Seconds every request waits before it is handled.
        :param max_stall: The most seconds a held or stalled request waits for its
            release.
        :param rate_limit: Requests per second past which the answer is 429; None: no
            limit.
        :param rate_limit_per_domain: Requests per second for each sending domain; None:
            no limit per domain.
        """
        self._api_key = api_key
        self._sent: list[SentEmail] = []
        self._sent_lock = threading.Lock()
        self._records: dict[str, dict[str, Any]] = {}  # by id, in send order
        self._templates: dict[str, dict[str, str]] = {}
        super().__init__(retention=retention, latency=latency, max_stall=max_stall,
                         rate_limit=rate_limit, group_rate_limit=rate_limit_per_domain)

    def set_rate_limit_per_domain(self, rate: float | None) -> None:
        """Admit at most ``rate`` sends per second from each sending domain (the
        lower-cased domain of ``from``), each from a token bucket of its own holding one
        second of requests, full at first (every domain's full again after this call);
        the rest get Resend's 429 ``rate_limit_exceeded``. Applies with ``rate_limit``,
        not instead. None lifts the limit. ValueError unless ``rate`` is a positive
        number or None."""
        self._set_group_rate_limit(rate)

    def requests_by_domain(self) -> dict[str, int]:
        """How many sends (``POST /emails`` and ``/emails/batch``) arrived per sending
        domain since ``reset()``, whatever their answer; a batch counts once for each
        distinct domain in it. Requests with no domain to read are not counted here
        (``total_requests`` counts them)."""
        return self._group_counts(throttled=False)

    def throttled_by_domain(self) -> dict[str, int]:
        """How many sends were answered 429 by a rate limit (``rate_limit`` or
        ``rate_limit_per_domain``) per sending domain since ``reset()``; a batch counts
        once for each distinct domain in it; domains never refused are absent."""
        return self._group_counts(throttled=True)

    def _rate_groups(self, request: Request) -> tuple[str, ...]:
        path = request.path.rstrip("/")
        if request.method != "POST" or path not in ("/emails", "/emails/batch"):
            return ()
        try:
            document = json.loads(request.body)
        except (ValueError, RecursionError):  # read before any check: any body may come
            return ()
        messages = document if isinstance(document, list) else [document]
        domains = (_sending_domain(m.get("from")) for m in messages if isinstance(m, dict))
        return tuple(d for d in domains if d is not None)

    @property
    def sent_emails(self) -> list[SentEmail]:
        """Every email sent, in order (replays are not sent again)."""
        with self._sent_lock:
            return list(self._sent)

    def add_template(self, template_id: str, *, subject: str | None = None,
                     html: str | None = None, text: str | None = None) -> None:
        """Register a published template for ``template: {"id": template_id}`` sends."""
        parts = {"subject": subject, "html": html, "text": text}
        with self._sent_lock:
            self._templates[template_id] = {k: v for k, v in parts.items() if v is not None}

    def _route(self, request: Request) -> Reply | None:
        path = request.path.rstrip("/")
        if path == "/emails" and request.method == "POST":
            return self._send_one(request)
        refusal = self._refusal(request)
        if refusal is not None:
            return refusal
        if (request.method, path) in (("POST", "/emails/batch"), ("GET", "/emails")):
            return self._send_batch(request) if request.method == "POST" else self._list(request)
        return self._on_email(request.method, path)

    def _on_email(self, method: str, path: str) -> Reply:
        """``GET /emails/{id}``, ``POST /emails/{id}/cancel``, or the refusal."""
        found = _EMAIL_PATH.match(path)
        if found is None and path not in ("/emails", "/emails/batch"):
            return self._error(404, "not_found", "The requested endpoint does not exist.")
        actions = {("GET", None): self._get, ("POST", "/cancel"): self._cancel}
        action = None if found is None else actions.get((method, found[2]))
        if found is None or action is None:
            return self._error(405, "method_not_allowed", "Method is not allowed.")
        return action(found[1])

    def _send_one(self, request: Request) -> Reply | None:
        refusal = self._refusal(request)
        if refusal is not None:
            return refusal
        message = _json_object(request.body)
        if message is None:
            return self._error(400, "validation_error", "The body must be a JSON object.")
        problem = self._problem(message)
        if problem is not None:
            return self._error(422, *problem)
        key = request.header("Idempotency-Key")
        fingerprint = json.dumps(message, sort_keys=True)
        return self._perform_once(key, fingerprint, lambda: self._send(key, message))

    def _send_batch(self, request: Request) -> Reply | None:
        try:
            messages = json.loads(request.body)
        except ValueError:
            messages = None
        if (not isinstance(messages, list) or not 1 <= len(messages) <= MAX_BATCH
                or not all(isinstance(m, dict) for m in messages)):
            return self._error(422, "validation_error",
                               f"The body must be an array of 1 to {MAX_BATCH} emails.")
        for index, message in enumerate(messages):
            problem = self._problem(message)
            if problem is not None:
                return self._error(422, problem[0], f"emails[{index}]: {problem[1]}")
        key = request.header("Idempotency-Key")
        fingerprint = json.dumps(["batch", messages], sort_keys=True)

        def send_all() -> Performed:
            ids = [self._record(key, message) for message in messages]
            return Reply.json(200, {"data": [{"id": i} for i in ids]}), True

        return self._perform_once(key, fingerprint, send_all)

    def _problem(self, message: dict[str, Any]) -> tuple[str, str] | None:
        template = message.get("template")
        if template is None:
            return _problem_with(message)
        if not isinstance(template, dict) or not isinstance(template.get("id"), str):
            return "validation_error", "Invalid `template` field."
        with self._sent_lock:
            known = self._templates.get(template["id"])
        if known is None:
            return "validation_error", f"Template {template['id']!r} not found."
        if "subject" not in message and "subject" not in known:
            return "missing_required_field", "Missing `subject` field."
        return _problem_with({**_rendered(known, template.get("variables")), **message})

    def _get(self, email_id: str) -> Reply:
        with self._sent_lock:
            record = self._records.get(email_id)
            found = None if record is None else {**record, "last_event": self._event(record)}
        if found is None:
            return self._error(404, "not_found", "Email not found")
        return Reply.json(200, found)

    def _list(self, request: Request) -> Reply:
        params = dict(parse_qsl(request.query))
        try:
            limit = int(params.get("limit", 20))
        except ValueError:
            limit = 0
        if not 1 <= limit <= 100:
            return self._error(422, "validation_error", "The `limit` must be 1 to 100.")
        with self._sent_lock:
            newest = [{**_listed(r), "last_event": self._event(r)}
                      for r in reversed(self._records.values())]
        ids = [r["id"] for r in newest]
        cursor = "after" if "after" in params else "before" if "before" in params else None
        if cursor is not None:
            if params[cursor] not in ids:
                return self._error(422, "validation_error", f"Invalid `{cursor}` cursor.")
            at = ids.index(params[cursor])
            newest = newest[at + 1:] if cursor == "after" else newest[max(0, at - limit):at]
        return Reply.json(200, {"object": "list", "has_more": len(newest) > limit,
                                "data": newest[:limit]})

    def _cancel(self, email_id: str) -> Reply:
        with self._sent_lock:
            record = self._records.get(email_id)
            cancellable = record is not None and self._event(record) == "scheduled"
            if cancellable:
                assert record is not None
                record["last_event"] = "canceled"
        if record is None:
            return self._error(404, "not_found", "Email not found")
        if not cancellable:
            return self._error(422, "validation_error",
                               "Only a scheduled email that has not been sent can be canceled.")
        return Reply.json(200, {"object": "email", "id": email_id})

    def _event(self, record: dict[str, Any]) -> str:
        """The email's last event now: scheduled until due, then delivered."""
        event = str(record["last_event"])
        if event == "scheduled" and record["_due"] <= self.now():
            return "delivered"
        return event

    def _record(self, key: str | None, message: dict[str, Any]) -> str:
        template = message.get("template")
        content = message if not isinstance(template, dict) else {
            **_rendered(self._templates.get(template["id"], {}), template.get("variables")),
            **{k: v for k, v in message.items() if k != "template"}}
        email = SentEmail(key, str(uuid.uuid4()), message, self.now())
        due = _due(message.get("scheduled_at"), self.now())
        record = {
            "object": "email", "id": email.id, "from": content.get("from"),
            "to": _as_list(content.get("to")), "subject": content.get("subject"),
            "html": content.get("html"), "text": content.get("text"),
            "cc": _as_list(content.get("cc")), "bcc": _as_list(content.get("bcc")),
            "reply_to": _as_list(content.get("reply_to")),
            "created_at": datetime.fromtimestamp(self.now(), UTC).isoformat(),
            "scheduled_at": message.get("scheduled_at"),
            "last_event": "scheduled" if due > self.now() else "delivered",
            "tags": content.get("tags") or [], "_due": due,
        }
        with self._sent_lock:
            self._sent.append(email)
            self._records[email.id] = record
        return email.id

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
        return Reply.json(200, {"id": self._record(key, message)}), True

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
            self._records.clear()


def _sending_domain(sender: object) -> str | None:
    """The lower-cased domain of a ``from`` value (``"Shop <shop@Example.com>"`` and
    ``"shop@example.com"`` are both ``example.com``), or None when it names none."""
    if not isinstance(sender, str):
        return None
    _, address = parseaddr(sender)
    local, at, domain = address.rpartition("@")
    domain = domain.strip().lower()
    return domain if at and local and domain else None


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


def _rendered(template: dict[str, str], variables: object) -> dict[str, str]:
    """A template's subject/html/text with ``{{{NAME}}}`` filled from ``variables``."""
    values = variables if isinstance(variables, dict) else {}

    def fill(text: str) -> str:
        return re.sub(r"\{\{\{(\w+)\}\}\}", lambda m: str(values.get(m[1], "")), text)

    return {part: fill(text) for part, text in template.items()}


def _listed(record: dict[str, Any]) -> dict[str, Any]:
    """An email as ``GET /emails`` shows it: no body, no tags."""
    hidden = {"html", "text", "tags", "_due"}
    return {k: v for k, v in record.items() if k not in hidden}


def _as_list(value: object) -> list[Any] | None:
    if value is None:
        return None
    return value if isinstance(value, list) else [value]


def _due(scheduled_at: object, now: float) -> float:
    if not isinstance(scheduled_at, str):
        return now
    try:
        return datetime.fromisoformat(scheduled_at.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return now


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
