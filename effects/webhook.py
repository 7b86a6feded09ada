"""``webhook.post``: deliver a signed JSON event to one HTTP endpoint.

The request body is ``{"data": ..., "event": ..., "id": <job key>}`` (compact JSON, keys
sorted, so every attempt sends the same bytes), signed per the Standard Webhooks
specification:

    webhook-id          the job's key, unchanged on every attempt: receivers dedupe on it
    webhook-timestamp   Unix seconds when this attempt was signed
    webhook-signature   v1,<base64 HMAC-SHA256(key, f"{id}.{timestamp}.{body}")>, one
                        per secret (several while a secret is rotated)

Receivers verify with the ``standardwebhooks`` (or ``svix``) library, or with
``verify_headers`` / ``effects.inbox``. Delivery is at least once; the effect is once
when the receiver deduplicates by ``webhook-id`` (or by the body's ``id``).

Outcome of a call, by what came back::

    2xx                                         done, ledger {"status": <code>}
    429, or 503 with Retry-After                Throttled(after=Retry-After): the
                                                receiver refused for load; every
                                                dispatcher pauses the effect, the attempt
                                                is not counted
    408, 409, 425, 5xx                          Retry(after=Retry-After)
    any other 4xx, or 1xx/3xx                   Permanent (redirects are not followed:
                                                they would re-send a signed body blindly)
    could not connect                           Retry: nothing reached the receiver
    timeout / dropped connection after sending  UnknownOutcome

409 is retried because receivers that deduplicate answer it for "a message with this id
is still being processed"; an id reused with another body gets 422, which is final.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field, JsonValue

from outbox import ConfigurationError, Job, Permanent, Retry

from ._cloudevents import Envelope, attributes, check_envelope
from ._http import USER_AGENT, PooledAdapter, retry_after, send, throttled
from ._payload import stop_if_told, validated_payload
from ._signing import (
    WebhookSecret,
    compute_signature,
    decode_secrets,
    generate_secret,
    verify_headers,
    verify_signature,
)

__all__ = [
    "PostWebhook",
    "WebhookPayload",
    "compute_signature",
    "generate_secret",
    "verify_headers",
    "verify_signature",
]

log = logging.getLogger("effects.webhook")

_RETRY_STATUSES = frozenset({408, 409, 425, 429})


class WebhookPayload(BaseModel):
    """A ``webhook.post`` payload: ``event``, a non-empty name, and ``data``, any JSON."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    event: str = Field(min_length=1, max_length=255)
    data: JsonValue


class PostWebhook(PooledAdapter):
    """POSTs ``webhook.post`` jobs to ``url`` as signed JSON.

    Guarantees: sends ``job.key`` as the ``webhook-id`` header and as the body's ``id``,
    unchanged on every attempt, and the same body bytes every time, so a receiver that
    deduplicates on either performs the event once. Each attempt is signed afresh with
    its own timestamp, per the Standard Webhooks specification. ``secret`` is one
    ``whsec_<base64>`` secret or a list of them: during a rotation every request carries
    one signature per secret, so receivers holding the old or the new one accept it.
    Redirects are never followed. One ``httpx.Client`` per instance, shared by all
    worker threads. With ``envelope="cloudevents"`` the request is also a CloudEvent in
    HTTP binary mode: the body is the canonical JSON of ``data`` alone (what is signed),
    with ``ce-id`` = the job key, ``ce-source`` = ``source``, ``ce-type`` = the event
    name, ``ce-time`` = the first attempt (see ``effects._cloudevents``). The secret
    never leaves the process; reasons and logs carry the job
    key, the receiver's host and the status, never the payload or the full URL (URLs may hold
    tokens). A missing, empty or malformed ``secret`` raises ``outbox.ConfigurationError``
    at construction, without repeating it.
    """

    name = "webhook.post"
    payload_model = WebhookPayload

    def __init__(
        self,
        url: str,
        secret: WebhookSecret | Sequence[WebhookSecret],
        timeout: float = 10.0,
        *,
        envelope: Envelope = None,
        source: str = "/outbox",
    ) -> None:
        """
        :param url: The receiver's URL; the body is POSTed there.
        :param secret: The signing secret (``whsec_<base64>``, or raw ``bytes``), or a
            list of them during a rotation (one signature each); empty raises
            ``outbox.ConfigurationError``.
        :param timeout: Seconds for each request; a read timeout after the request was
            sent is an ``UnknownOutcome``.
        :param envelope: None for the plain body (``{"id", "event", "data"}``), or
            ``"cloudevents"`` for a CloudEvents envelope.
        :param source: The CloudEvents ``source`` attribute, with that envelope.
        """
        check_envelope(envelope, source)
        self.envelope, self.source = envelope, source
        if not secret:
            raise ConfigurationError("PostWebhook needs a signing secret: secret is missing "
                                     "or empty")
        self._url = httpx.URL(url)
        try:  # refuses a malformed secret now, not per job
            self._keys = decode_secrets(secret)
        except ValueError as exc:  # the message never repeats the secret
            raise ConfigurationError(f"PostWebhook: {exc}") from None
        self._client = httpx.Client(
            timeout=timeout, follow_redirects=False, headers={"User-Agent": USER_AGENT}
        )

    def perform(self, job: Job) -> dict[str, Any]:
        """Deliver the job's event; return ``{"status": <HTTP status>}`` for the ledger.

        Raises ``Retry``, ``Permanent`` or ``UnknownOutcome`` as drawn in the module
        docstring.
        """
        hook = validated_payload(WebhookPayload, job)
        headers: dict[str, str] = {}
        if self.envelope == "cloudevents":
            body = _encode_data(job.key, hook)
            headers = attributes(job, source=self.source, type_=hook.event, prefix="ce-")
        else:
            body = _encode_body(job.key, hook)
        request = self._client.build_request(
            "POST", self._url, content=body, headers={**headers, **self._headers(job.key, body)}
        )
        what = f"webhook job {job.key} to {self._url.host}"
        stop_if_told(job, what)
        response = send(self._client, request, what=what)
        return _outcome(response, what)

    def close(self) -> None:
        """Close the HTTP connection pool. The adapter cannot deliver afterwards."""
        self._client.close()

    def __repr__(self) -> str:
        return f"PostWebhook(host={self._url.host!r})"

    def _headers(self, key: str, body: bytes) -> dict[str, str]:
        timestamp = int(time.time())
        return {
            "Content-Type": "application/json",
            "webhook-id": key,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": compute_signature(self._keys, key, timestamp, body),
        }


def _encode_body(key: str, hook: WebhookPayload) -> bytes:
    """The exact bytes posted for ``hook`` under ``key``: the same on every attempt."""
    document = {"id": key, "event": hook.event, "data": hook.data}
    try:
        text = json.dumps(
            document, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )
    except ValueError as exc:  # NaN or infinity: not JSON, and never will be
        raise Permanent(f"invalid webhook.post payload for job {key}: data: not JSON") from exc
    return text.encode()


def _encode_data(key: str, hook: WebhookPayload) -> bytes:
    """A CloudEvent's body: the data alone, canonical JSON (the same on every attempt)."""
    try:
        text = json.dumps(hook.data, sort_keys=True, separators=(",", ":"),
                          ensure_ascii=False, allow_nan=False)
    except ValueError as exc:
        raise Permanent(f"invalid webhook.post payload for job {key}: data: not JSON") from exc
    return text.encode()


def _outcome(response: httpx.Response, what: str) -> dict[str, Any]:
    status = response.status_code
    if response.is_success:
        log.debug("%s delivered (HTTP %d)", what, status)
        return {"status": status}
    reason = f"{what}: receiver answered HTTP {status}"
    pushed_back = throttled(status, response.headers, reason)
    if pushed_back is not None:
        log.info("%s; throttled", reason)
        raise pushed_back
    if status in _RETRY_STATUSES or status >= 500:
        log.info("%s; will retry", reason)
        raise Retry(reason, after=retry_after(response.headers))
    log.warning("%s; giving up", reason)
    raise Permanent(reason)
