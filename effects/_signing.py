"""Webhook signatures: HMAC-SHA256 over ``"{timestamp}.{body}"``, sent as ``v1=<hex>``.

Kept free of any outbox import so that receivers (and the fake receiver in
``effects.testing``) can verify signatures without the dispatcher's dependencies.
"""

from __future__ import annotations

import hashlib
import hmac
import time

__all__ = ["SIGNATURE_VERSION", "compute_signature", "verify_signature"]

SIGNATURE_VERSION = "v1"


def compute_signature(secret: str, timestamp: int | str, body: bytes | str) -> str:
    """The ``Webhook-Signature`` header value for ``body`` sent at ``timestamp``.

    The signature is ``v1=`` followed by the hex HMAC-SHA256, keyed with ``secret``, of
    ``f"{timestamp}.{body}"``. Signing the timestamp with the body stops a captured
    request from being replayed later with a fresh timestamp.
    """
    message = f"{timestamp}.".encode() + _as_bytes(body)
    digest = hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()
    return f"{SIGNATURE_VERSION}={digest}"


def verify_signature(
    secret: str,
    timestamp: int | str,
    body: bytes | str,
    signature: str,
    tolerance: float = 300,
    *,
    now: float | None = None,
) -> bool:
    """True when ``signature`` is a valid signature of ``body`` at a recent ``timestamp``.

    ``timestamp``, ``body`` and ``signature`` are the ``Webhook-Timestamp`` header, the
    raw request body (exactly as received, before any JSON parsing) and the
    ``Webhook-Signature`` header. The header may carry several space- or comma-separated
    ``v1=`` values (e.g. while a secret is rotated); one match is enough. Timestamps more
    than ``tolerance`` seconds away from ``now`` (default: the current time) are refused,
    which bounds replays. Comparison is constant-time.
    """
    sent_at = _parse_timestamp(timestamp)
    if sent_at is None:
        return False
    current = time.time() if now is None else now
    if abs(current - sent_at) > tolerance:
        return False
    expected = compute_signature(secret, sent_at, body)
    return any(hmac.compare_digest(expected, candidate) for candidate in _candidates(signature))


def _parse_timestamp(timestamp: int | str) -> int | None:
    if isinstance(timestamp, int):
        return timestamp
    text = timestamp.strip()
    return int(text) if text.isascii() and text.isdigit() else None


def _candidates(signature: str) -> list[str]:
    parts = signature.replace(",", " ").split()
    return [part for part in parts if part.startswith(f"{SIGNATURE_VERSION}=")]


def _as_bytes(body: bytes | str) -> bytes:
    return body.encode() if isinstance(body, str) else body
