"""Webhook signatures per the Standard Webhooks specification (standardwebhooks.com).

A signed request carries three headers::

    webhook-id          the message id: the outbox job's key, the same on every attempt
    webhook-timestamp   Unix seconds when this attempt was signed
    webhook-signature   "v1,<base64 HMAC-SHA256(key, f'{id}.{timestamp}.{body}')>", one
                        per secret, separated by spaces (several while a secret rotates)

Secrets are ``whsec_`` followed by the base64 of the key bytes (the prefix is optional);
the HMAC is keyed with the decoded bytes. Receivers using the ``standardwebhooks`` or
``svix`` libraries verify these signatures, and ``verify_signature`` / ``verify_headers``
here verify theirs.

Kept free of any outbox import so that receivers (and the fake receiver in
``effects.testing``) can verify signatures without the dispatcher's dependencies.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets as _random
import time
from collections.abc import Mapping, Sequence

__all__ = [
    "SECRET_PREFIX",
    "SIGNATURE_VERSION",
    "WebhookSecret",
    "compute_signature",
    "decode_secret",
    "generate_secret",
    "verify_headers",
    "verify_signature",
]

SIGNATURE_VERSION = "v1"
SECRET_PREFIX = "whsec_"
DEFAULT_TOLERANCE = 300.0

WebhookSecret = str | bytes
"""A ``whsec_<base64>`` string (prefix optional) or the raw key bytes."""


def decode_secret(secret: WebhookSecret) -> bytes:
    """The HMAC key of ``secret``: the raw bytes, or the base64 after ``whsec_`` decoded.

    Raises ``ValueError`` for an empty key or text that is not base64; the message never
    repeats the secret.
    """
    if isinstance(secret, bytes):
        key = secret
    else:
        text = secret.removeprefix(SECRET_PREFIX).strip()
        try:
            # Unpadded base64 is common in the wild: pad it, then decode strictly.
            key = base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(
                "webhook secret must be 'whsec_' followed by base64 (as the Standard "
                "Webhooks specification defines), or raw bytes"
            ) from exc
    if not key:
        raise ValueError("webhook secret is empty")
    return key


def decode_secrets(secrets: WebhookSecret | Sequence[WebhookSecret]) -> list[bytes]:
    """One or several secrets as HMAC keys, in order; at least one is required."""
    many = [secrets] if isinstance(secrets, str | bytes) else list(secrets)
    if not many:
        raise ValueError("at least one webhook secret is required")
    return [decode_secret(secret) for secret in many]


def generate_secret(nbytes: int = 32) -> str:
    """A fresh random secret in the ``whsec_<base64>`` form, to share with a receiver."""
    return SECRET_PREFIX + base64.b64encode(_random.token_bytes(nbytes)).decode()


def compute_signature(
    secrets: WebhookSecret | Sequence[WebhookSecret],
    msg_id: str,
    timestamp: int | str,
    body: bytes | str,
) -> str:
    """The ``webhook-signature`` header for ``body`` sent as ``msg_id`` at ``timestamp``.

    One ``v1,<base64>`` value per secret, space-separated: during a rotation, sign with
    the new and the old secret so receivers holding either accept the request. Signing
    the id and the timestamp with the body stops a captured request from being replayed
    later under a fresh timestamp or another id.
    """
    message = f"{msg_id}.{timestamp}.".encode() + _as_bytes(body)
    return " ".join(_sign(key, message) for key in decode_secrets(secrets))


def verify_signature(
    secrets: WebhookSecret | Sequence[WebhookSecret],
    msg_id: str,
    timestamp: int | str,
    body: bytes | str,
    signature: str,
    tolerance: float = DEFAULT_TOLERANCE,
    *,
    now: float | None = None,
) -> bool:
    """True when ``signature`` holds a valid signature of ``body`` at a recent ``timestamp``.

    ``msg_id``, ``timestamp`` and ``signature`` are the ``webhook-id``,
    ``webhook-timestamp`` and ``webhook-signature`` headers; ``body`` is the raw request
    body exactly as received, before any JSON parsing. One match among the header's
    ``v1,`` values against any of ``secrets`` is enough (a receiver accepts the old and
    the new secret while rotating). Timestamps more than ``tolerance`` seconds away from
    ``now`` (default: the current time) are refused, which bounds replays. Comparisons
    are constant-time.
    """
    sent_at = _parse_timestamp(timestamp)
    if sent_at is None or not msg_id:
        return False
    current = time.time() if now is None else now
    if abs(current - sent_at) > tolerance:
        return False
    message = f"{msg_id}.{sent_at}.".encode() + _as_bytes(body)
    candidates = _candidates(signature)
    expected = [_digest(key, message) for key in decode_secrets(secrets)]
    return any(hmac.compare_digest(e, c) for e in expected for c in candidates)


def verify_headers(
    secrets: WebhookSecret | Sequence[WebhookSecret],
    headers: Mapping[str, str],
    body: bytes | str,
    tolerance: float = DEFAULT_TOLERANCE,
    *,
    now: float | None = None,
) -> str | None:
    """The verified ``webhook-id`` of a request, or None when its signature does not hold.

    ``headers`` may use any letter case (a plain dict or a framework's header mapping).
    """
    lowered = {name.lower(): value for name, value in headers.items()}
    msg_id = lowered.get("webhook-id", "")
    ok = verify_signature(
        secrets,
        msg_id,
        lowered.get("webhook-timestamp", ""),
        body,
        lowered.get("webhook-signature", ""),
        tolerance,
        now=now,
    )
    return msg_id if ok else None


def _sign(key: bytes, message: bytes) -> str:
    return f"{SIGNATURE_VERSION},{base64.b64encode(_digest(key, message)).decode()}"


def _digest(key: bytes, message: bytes) -> bytes:
    return hmac.new(key, message, hashlib.sha256).digest()


def _parse_timestamp(timestamp: int | str) -> int | None:
    if isinstance(timestamp, int):
        return timestamp
    text = timestamp.strip()
    return int(text) if text.isascii() and text.isdigit() else None


def _candidates(signature: str) -> list[bytes]:
    """The decoded ``v1,`` signatures in the header; other versions and junk are skipped."""
    found = []
    for part in signature.split():
        version, _, encoded = part.partition(",")
        if version != SIGNATURE_VERSION or not encoded:
            continue
        try:
            found.append(base64.b64decode(encoded, validate=True))
        except (binascii.Error, ValueError):
            continue
    return found


def _as_bytes(body: bytes | str) -> bytes:
    return body.encode() if isinstance(body, str) else body
