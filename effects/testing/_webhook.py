"""``FakeWebhookReceiver``: an endpoint that checks signatures and deduplicates by key."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._signing import WebhookSecret, decode_secrets, verify_signature
from ._base import DAY, FakeProvider, Performed
from ._http import Reply, Request

__all__ = ["FakeWebhookReceiver", "ReceivedWebhook"]

_DEFAULT_ERRORS = {
    400: "bad_request",
    401: "invalid_signature",
    409: "request_in_progress",
    422: "key_reused",
    429: "rate_limited",
}


@dataclass(frozen=True)
class ReceivedWebhook:
    """One event the receiver accepted (and performed): key, event name, data, timestamp."""

    key: str
    event: str
    data: Any
    timestamp: int


class FakeWebhookReceiver(FakeProvider):
    """A webhook endpoint at ``url`` that behaves as a careful receiver should.

    - Checks ``webhook-id``, ``webhook-timestamp`` and ``webhook-signature`` per the
      Standard Webhooks specification against ``secret`` (one ``whsec_`` secret or a
      list, as a receiver holds during a rotation), on wall-clock time with
      ``tolerance`` seconds (401 if wrong or missing).
    - Requires a JSON body whose ``id`` equals ``webhook-id``, with ``event`` and
      ``data`` (400).
    - Deduplicates by ``webhook-id``: the first delivery is performed and its answer
      saved for ``retention``; the same body again is acknowledged without being
      performed again; another body with the id gets 422; a delivery while the first is
      in flight gets 409.

    Error bodies are ``{"error": "<name>", "message": "..."}``. Faults and counters: see
    ``FakeProvider``; ``received`` lists the events performed.
    """

    def __init__(
        self,
        secret: WebhookSecret | Sequence[WebhookSecret],
        *,
        tolerance: float = 300,
        path: str = "/webhook",
        retention: float = DAY,
        latency: float = 0.0,
        max_stall: float = 60.0,
    ) -> None:
        """
        :param secret: The ``whsec_`` secret requests must be signed with, or a list of
            them (a rotation); a malformed one raises here.
        :param tolerance: Seconds a request's ``webhook-timestamp`` may be off (else 401).
        :param path: The path requests are POSTed to (others get 404).
        :param retention: Seconds of the fake's clock a ``webhook-id`` is remembered.
        :param latency: Seconds every request waits before it is handled.
        :param max_stall: The most seconds a held or stalled request waits for its
            release.
        """
        decode_secrets(secret)  # a malformed secret is refused here, not as 401s later
        self.secret = secret
        self.tolerance = tolerance
        self._path = "/" + path.strip("/")
        self._received: list[ReceivedWebhook] = []
        self._received_lock = threading.Lock()
        super().__init__(retention=retention, latency=latency, max_stall=max_stall)

    @property
    def url(self) -> str:
        """The endpoint to post to: ``http://127.0.0.1:<port>/webhook``."""
        return super().url + self._path

    @property
    def received(self) -> list[ReceivedWebhook]:
        """Every event performed, in order (acknowledged duplicates are not repeated)."""
        with self._received_lock:
            return list(self._received)

    def _request_key(self, request: Request) -> str | None:
        return request.header("webhook-id")

    def _route(self, request: Request) -> Reply | None:
        if request.path.rstrip("/") != self._path:
            return self._error(404, "not_found", "No endpoint here.")
        if request.method != "POST":
            return self._error(405, "method_not_allowed", "POST only.")
        key = request.header("webhook-id") or ""
        timestamp = request.header("webhook-timestamp") or ""
        signature = request.header("webhook-signature") or ""
        if not verify_signature(
            self.secret, key, timestamp, request.body, signature, self.tolerance
        ):
            return self._error(
                401, "invalid_signature", "Signature, id or timestamp is missing or invalid."
            )
        event = _event_of(request.body, key)
        if event is None:
            return self._error(400, "bad_request", "Body must be {id: <webhook-id>, event, data}.")
        fingerprint = hashlib.sha256(request.body).hexdigest()
        return self._perform_once(
            key, fingerprint, lambda: self._accept(key, event, int(timestamp))
        )

    def _accept(self, key: str, event: dict[str, Any], timestamp: int) -> Performed:
        received = ReceivedWebhook(key, event["event"], event["data"], timestamp)
        with self._received_lock:
            self._received.append(received)
        return Reply.json(200, {"received": True}), True

    def _error(
        self, status: int, code: str | None, message: str, retry_after: float | None = None
    ) -> Reply:
        name = code or _DEFAULT_ERRORS.get(status) or f"http_{status}"
        headers = () if retry_after is None else (("Retry-After", str(int(retry_after))),)
        return Reply.json(status, {"error": name, "message": message}, headers)

    def _key_mismatch(self, key: str) -> Reply:
        return self._error(422, "key_reused", "This webhook-id was used with another body.")

    def _key_in_flight(self, key: str) -> Reply:
        return self._error(409, "request_in_progress", "A message with this id is running.")

    def _forget_records(self) -> None:
        with self._received_lock:
            self._received.clear()


def _event_of(body: bytes, key: str) -> dict[str, Any] | None:
    try:
        document = json.loads(body)
    except ValueError:
        return None
    if not isinstance(document, dict) or document.get("id") != key:
        return None
    if not isinstance(document.get("event"), str) or "data" not in document:
        return None
    return document
