"""What the HTTP adapters share: the one place httpx errors become outcomes, and helpers.

A transport failure is classified by whether the request can have reached the provider:

    could not connect (ConnectError, ConnectTimeout, PoolTimeout, ProxyError)
        -> Retry: nothing was sent, so trying again cannot act twice
    request unbuildable (UnsupportedProtocol, LocalProtocolError)
        -> Permanent: a wrong base URL or header; retrying cannot fix it
    anything after the request left (ReadTimeout, WriteTimeout, ReadError,
    WriteError, RemoteProtocolError, ...)
        -> UnknownOutcome: the provider may have acted; the same idempotency key
           makes a resend safe while the provider remembers it
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from email.utils import parsedate_to_datetime
from typing import Self

import httpx

from outbox import Effect, Permanent, Retry, Throttled, UnknownOutcome

__all__ = [
    "NOT_SENT_ERRORS",
    "USER_AGENT",
    "PooledAdapter",
    "never_reached_provider",
    "provider_rate",
    "redact",
    "retry_after",
    "send",
    "throttled",
]

USER_AGENT = "outbox-effects/0.1"

# Failures that happen before a single byte of the request reaches the provider.
NOT_SENT_ERRORS: tuple[type[Exception], ...] = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.PoolTimeout,
    httpx.ProxyError,
)

# Failures of our own making: the request could not even be written.
_UNBUILDABLE_ERRORS: tuple[type[Exception], ...] = (
    httpx.UnsupportedProtocol,
    httpx.LocalProtocolError,
)

_MAX_REASON_DETAIL = 300


class PooledAdapter(Effect):
    """An adapter that holds a connection pool: ``close()`` releases it, and ``with``
    closes it on the way out."""

    def close(self) -> None:
        """Release the connection pool; the adapter cannot call its provider afterwards."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def send(client: httpx.Client, request: httpx.Request, *, what: str) -> httpx.Response:
    """Send ``request`` and read the response, translating transport failures.

    ``what`` names the job in reasons (e.g. ``"email job email-order-102"``); it must
    carry keys and ids only. Raises ``Retry``, ``Permanent`` or ``UnknownOutcome`` as
    drawn in the module docstring, with the httpx error kept as ``__cause__``.
    """
    try:
        return client.send(request)
    except NOT_SENT_ERRORS as exc:
        raise Retry(f"{what}: could not connect ({type(exc).__name__}); nothing sent") from exc
    except _UNBUILDABLE_ERRORS as exc:
        raise Permanent(f"{what}: request could not be sent ({type(exc).__name__})") from exc
    except httpx.TransportError as exc:
        raise UnknownOutcome(
            f"{what}: {type(exc).__name__} after the request was sent; "
            "the provider may have acted"
        ) from exc


def never_reached_provider(exc: BaseException | None) -> bool:
    """True when ``exc`` is an httpx failure that happened before anything was sent."""
    return isinstance(exc, NOT_SENT_ERRORS)


def retry_after(headers: Mapping[str, str], *, now: float | None = None) -> float | None:
    """Seconds to wait according to a ``Retry-After`` header, or None when absent or bad.

    Accepts both forms of RFC 9110: delay-seconds and an HTTP-date. A date in the past
    gives 0.
    """
    value = _header(headers, "retry-after")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return _seconds_until(value, time.time() if now is None else now)
    if math.isnan(seconds) or math.isinf(seconds):
        return None
    return max(0.0, seconds)


def provider_rate(headers: Mapping[str, str]) -> float | None:
    """Requests per second the provider says it admits, from ``ratelimit-limit`` (and the
    window of ``ratelimit-policy``, ``"2;w=1"``, when sent; one second otherwise, as
    Resend's limit is per second), or None when it says nothing readable."""
    value = _header(headers, "ratelimit-limit")
    if value is None:
        return None
    try:
        limit = float(value.split(",")[0].split(";")[0])
    except ValueError:
        return None
    window = 1.0
    policy = _header(headers, "ratelimit-policy")
    if policy is not None:
        for part in policy.split(";")[1:]:
            name, _, number = part.strip().partition("=")
            if name == "w":
                try:
                    window = float(number)
                except ValueError:
                    return None
    if not (math.isfinite(limit) and limit > 0 and math.isfinite(window) and window > 0):
        return None
    return limit / window


def throttled(status: int, headers: Mapping[str, str], reason: str) -> Throttled | None:
    """``Throttled`` for an answer that means "refused for load, nothing done": a 429,
    or a 503 with ``Retry-After`` (a provider shedding load names when to come back; a
    bare 503 is an outage, left to retries and the breaker). None otherwise."""
    after = retry_after(headers)
    if status == 429 or (status == 503 and after is not None):
        return Throttled(after=after, reason=reason, rate=provider_rate(headers))
    return None


def redact(text: str, secret: str) -> str:
    """``text`` with ``secret`` masked and the length capped, fit for a reason or a log."""
    if secret:
        text = text.replace(secret, "[redacted]")
    if len(text) > _MAX_REASON_DETAIL:
        text = text[: _MAX_REASON_DETAIL - 3] + "..."
    return text


def _header(headers: Mapping[str, str], name: str) -> str | None:
    # Provider libraries hand over plain dicts as well as case-insensitive ones.
    for key, value in headers.items():
        if key.lower() == name:
            return value
    return None


def _seconds_until(http_date: str, now: float) -> float | None:
    try:
        moment = parsedate_to_datetime(http_date)
    except (TypeError, ValueError, IndexError):
        return None
    return max(0.0, moment.timestamp() - now)
