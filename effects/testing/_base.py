"""What every fake provider shares: the server, the key memory, faults and counters."""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection
from typing import Self

from ._faults import Failure, Faults, Hold, PostFault, PreFault
from ._http import LocalServer, Reply, Request
from ._idempotency import IdempotencyStore, KeyState

__all__ = ["DAY", "FakeProvider", "Performed"]

DAY = 24 * 60 * 60.0

# What a fake's operation returns: its answer, and whether it executed (a request that
# executed is counted as performed and its answer saved under its idempotency key).
Performed = tuple[Reply, bool]


class FakeProvider:
    """Base of the fake providers: a real HTTP server on 127.0.0.1 with a provider's
    idempotency semantics, fault injection and counters. Thread-safe throughout.

    The server starts when the object is made and stops on ``close()`` (or leaving a
    ``with`` block), which also joins its threads. ``url`` is its base URL.

    Idempotency: the first request with a key is performed and its answer saved for
    ``retention`` seconds of the fake's clock (``advance()`` moves it on); the same
    request again gets the saved answer without being performed again; another request
    with the key, or the same one while the first is in flight, gets the provider's
    error. ``performed(key)`` says how many times a key was really performed: 1 is
    "once".

    Faults, each counted per request and consumed once, checked in this order:
    ``drop_connection`` (closed unanswered, nothing performed), ``fail_next`` (error
    answer, nothing performed), then after performing ``succeed_then_timeout`` (answer
    stalled until ``release_stalled()``/``close()``) or ``succeed_then_drop`` (closed
    unanswered). ``hold_next()`` holds a request in flight; ``set_latency()`` slows
    every request. Tests synchronise on events, not sleeps: ``Hold.wait_for_arrival()``
    and ``wait_for_stalls()``.

    Pushing back, as providers do: with ``rate_limit`` (requests per second, also
    ``set_rate_limit()``) requests past the limit are answered 429 in the provider's
    format, before anything else is looked at, by a token bucket holding one second of
    requests (``throttled`` counts them); ``set_outage(True)`` answers every request 503
    without performing it until ``set_outage(False)`` (``outage_requests`` counts them).

    Per-tenant limits: a provider whose requests name the tenant they count against (the
    account at Stripe, the sending domain at Resend) can also give each tenant a bucket
    of its own, the same token bucket at a rate of its own (``FakeStripe``'s
    ``rate_limit_per_account``, ``FakeEmailProvider``'s ``rate_limit_per_domain``; they
    pass it on as ``group_rate_limit``, which a provider naming no tenant ignores). A
    request is admitted only when every bucket it counts against (the server's and its
    tenants') holds a token, and then takes one from each; one refused takes none, so a
    tenant refused does not spend the server's budget nor the other way round. A tenant's
    bucket is made full when its first request arrives and kept for the fake's life (one
    per tenant ever seen: memory is not bounded, which a test fake can afford).
    """

    def __init__(
        self, *, retention: float = DAY, latency: float = 0.0, max_stall: float = 60.0,
        rate_limit: float | None = None, group_rate_limit: float | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._faults = Faults(latency=latency, max_stall=max_stall)
        self._keys = IdempotencyStore(retention)
        self._clock_offset = 0.0
        self._performed: Counter[str] = Counter()
        self._requests: Counter[str] = Counter()
        self._total_performed = 0
        self._total_requests = 0
        self._limiter: _TokenBucket | None = None
        self._group_rate: float | None = None  # each tenant's own limit, if any
        self._group_limiters: dict[str, _TokenBucket] = {}
        self._group_requests: Counter[str] = Counter()
        self._group_throttled: Counter[str] = Counter()
        self._outage: float | None = None  # None: up; else the outage's Retry-After (or nan)
        self._throttled = 0
        self._outage_requests = 0
        if rate_limit is not None:
            self.set_rate_limit(rate_limit)
        self._set_group_rate_limit(group_rate_limit)
        self._server = LocalServer(self._answer, name=type(self).__name__)
        self._closed = False

    # -- lifecycle ----------------------------------------------------------------

    @property
    def url(self) -> str:
        """The base URL, ``http://127.0.0.1:<port>``."""
        return f"http://127.0.0.1:{self._server.port}"

    def close(self) -> None:
        """Release held and stalled requests, stop the server, join its threads.

        Idempotent.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._closing.set()
        self._faults.close()
        self._server.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def reset(self) -> None:
        """Forget every key, count and record, disarm every fault, rewind the clock."""
        self._faults.clear()
        self._keys.clear()
        with self._lock:
            self._clock_offset = 0.0
            self._throttled = 0
            self._outage_requests = 0
            self._outage = None
            self._performed.clear()
            self._requests.clear()
            self._group_requests.clear()
            self._group_throttled.clear()
            self._total_performed = 0
            self._total_requests = 0
        self._forget_records()

    # -- clock --------------------------------------------------------------------

    @property
    def retention(self) -> float:
        """Seconds an answered key is remembered (24 hours unless set)."""
        return self._keys.retention

    def now(self) -> float:
        """The fake's clock: wall time plus everything ``advance()`` added."""
        with self._lock:
            return time.time() + self._clock_offset

    def advance(self, seconds: float) -> None:
        """Move the fake's clock on, e.g. past ``retention`` so keys are forgotten."""
        if seconds < 0:
            raise ValueError("the clock only moves forward")
        with self._lock:
            self._clock_offset += seconds

    # -- faults -------------------------------------------------------------------

    def set_latency(self, seconds: float) -> None:
        """Delay every following request by ``seconds`` before handling it (0 stops)."""
        self._faults.set_latency(seconds)

    def disarm_pending(self, keep: Collection[str] = ()) -> int:
        """Disarm the faults armed by ``fail_next``, ``drop_connection``,
        ``succeed_then_timeout`` and ``succeed_then_drop`` that no request has met yet,
        and return how many there were: errors come in bursts in time, and a client that
        stopped sending (a breaker) would otherwise meet a queue of them later. Faults
        of a kind in ``keep`` stay armed: ``"failure"`` (``fail_next`` with a status
        other than 429), ``"429"``, ``"drop"`` (``drop_connection``), ``"stall"``
        (``succeed_then_timeout``), ``"post_drop"`` (``succeed_then_drop``)."""
        return self._faults.disarm_pending(keep)

    def faults_met(self, kind: str) -> int:
        """How many armed one-shot faults of ``kind`` (named as for ``disarm_pending``'s
        ``keep``) requests have met so far."""
        return self._faults.met(kind)

    def set_rate_limit(self, rate: float | None) -> None:
        """Admit at most ``rate`` requests per second (a token bucket holding one second
        of requests, full at first); the rest are answered 429 as the provider does.
        None lifts the limit."""
        rate = _checked_rate("rate_limit", rate)
        with self._lock:
            self._limiter = None if rate is None else _TokenBucket(rate, time.monotonic())

    def set_outage(self, down: bool = True, *, retry_after: float | None = None) -> None:
        """Start (``down=True``) or end an outage: meanwhile every request is answered
        503 in the provider's format and nothing is performed. ``retry_after`` adds a
        ``Retry-After`` header (a provider shedding load rather than down)."""
        with self._lock:
            self._outage = (math.nan if retry_after is None else retry_after) if down else None

    @property
    def throttled(self) -> int:
        """How many requests were answered 429 by ``rate_limit`` or a per-tenant limit."""
        with self._lock:
            return self._throttled

    @property
    def outage_requests(self) -> int:
        """How many requests arrived during an outage (``set_outage``)."""
        with self._lock:
            return self._outage_requests

    def fail_next(
        self,
        n: int = 1,
        status: int = 503,
        *,
        retry_after: float | None = None,
        error: str | None = None,
    ) -> None:
        """Answer the next ``n`` requests with ``status`` in the provider's error format,
        without performing them. ``retry_after`` adds a ``Retry-After`` header;
        ``error`` sets the provider's error name/code (a default fits the status)."""
        self._faults.fail_next(n, Failure(status, retry_after, error))

    def drop_connection(self, n: int = 1) -> None:
        """Read the next ``n`` requests, then close their connections unanswered,
        before performing them."""
        self._faults.drop_connection(n)

    def succeed_then_timeout(self, n: int = 1) -> None:
        """Perform the next ``n`` requests and save their answers, then stall the
        answers until ``release_stalled()`` or ``close()``, past any client timeout."""
        self._faults.after_perform(n, PostFault.STALL)

    def succeed_then_drop(self, n: int = 1) -> None:
        """Perform the next ``n`` requests and save their answers, then close their
        connections without answering."""
        self._faults.after_perform(n, PostFault.DROP)

    def hold_next(self) -> Hold:
        """Hold the next keyed request in flight, before it is performed; see ``Hold``."""
        return self._faults.hold_next()

    def release_stalled(self) -> None:
        """Send the answers stalled by ``succeed_then_timeout`` now."""
        self._faults.release_stalled()

    def wait_for_stalls(self, n: int = 1, timeout: float = 10.0) -> None:
        """Block until ``n`` answers (counted since the last ``reset()``) have been
        stalled by ``succeed_then_timeout``, i.e. performed and saved; a test's way to
        know without sleeping. AssertionError after ``timeout`` seconds."""
        self._faults.wait_for_stalls(n, timeout)

    # -- counters -----------------------------------------------------------------

    def performed(self, key: str) -> int:
        """How many times a request with ``key`` was really performed (1 is "once")."""
        with self._lock:
            return self._performed[key]

    def performed_keys(self) -> list[str]:
        """The keys performed at least once, in the order first performed."""
        with self._lock:
            return list(self._performed)

    def requests(self, key: str) -> int:
        """How many requests arrived with ``key``: performed, replayed, refused, failed."""
        with self._lock:
            return self._requests[key]

    @property
    def total_performed(self) -> int:
        """How many requests were performed, with or without a key."""
        with self._lock:
            return self._total_performed

    @property
    def total_requests(self) -> int:
        """How many requests arrived, with or without a key."""
        with self._lock:
            return self._total_requests

    # -- for subclasses -----------------------------------------------------------

    def _route(self, request: Request) -> Reply | None:
        """Answer a request that no fault intercepted."""
        raise NotImplementedError

    def _error(
        self, status: int, code: str | None, message: str, retry_after: float | None = None
    ) -> Reply:
        """An error answer in the provider's format (``code`` None: one fitting status)."""
        raise NotImplementedError

    def _replayed(self, reply: Reply) -> Reply:
        """How a saved answer goes out again (providers may mark replays)."""
        return reply

    def _rate_limited(self, limit: float, remaining: int, retry_after: int, reset: int) -> Reply:
        """The provider's 429 for a request past ``rate_limit`` or a tenant's limit
        (``limit`` is the rate of the bucket that refused it)."""
        return self._error(429, None, "Too many requests", retry_after)

    def _key_mismatch(self, key: str) -> Reply:
        raise NotImplementedError

    def _key_in_flight(self, key: str) -> Reply:
        raise NotImplementedError

    def _forget_records(self) -> None:
        """Drop the subclass's records of what was performed (on ``reset()``)."""

    def _rate_groups(self, request: Request) -> tuple[str, ...]:
        """The tenants ``request`` counts against for per-tenant limits and counts (none:
        only the server's limit applies); read before anything else, so it must accept
        any request, however malformed."""
        return ()

    # The public name of the per-tenant limit's setting, for its errors.
    _group_limit_name = "group_rate_limit"

    def _set_group_rate_limit(self, rate: float | None) -> None:
        """Give each tenant a bucket of ``rate`` requests per second (None: no per-tenant
        limit); every tenant's bucket starts full again."""
        rate = _checked_rate(self._group_limit_name, rate)
        with self._lock:
            self._group_rate = rate
            self._group_limiters.clear()

    def _group_counts(self, *, throttled: bool) -> dict[str, int]:
        """Requests (or those answered 429 by a rate limit) per tenant, since ``reset()``."""
        with self._lock:
            return dict(self._group_throttled if throttled else self._group_requests)

    def _perform_once(
        self, key: str | None, fingerprint: str, operation: Callable[[], Performed]
    ) -> Reply | None:
        """Run ``operation`` under the idempotency rules for ``key`` (None: no key)."""
        if key is None:
            return self._executed(None, operation())
        begun = self._keys.begin(key, fingerprint, self.now())
        if begun.reply is not None:  # only a replay carries the saved answer
            return self._replayed(begun.reply)
        if begun.state is KeyState.MISMATCH:
            return self._key_mismatch(key)
        if begun.state is KeyState.IN_FLIGHT:
            return self._key_in_flight(key)
        try:
            self._faults.hold_if_armed()
            reply, executed = operation()
        except BaseException:
            self._keys.abandon(key)
            raise
        if not executed:
            self._keys.abandon(key)
            return reply
        self._keys.save(key, reply, self.now())
        return self._executed(key, (reply, executed))

    # -- internals ----------------------------------------------------------------

    def _executed(self, key: str | None, performed: Performed) -> Reply | None:
        reply, executed = performed
        if not executed:
            return reply
        with self._lock:
            self._total_performed += 1
            if key is not None:
                self._performed[key] += 1
        return self._after_perform(reply)

    def _after_perform(self, reply: Reply) -> Reply | None:
        fault = self._faults.take_post()
        if fault is PostFault.DROP:
            return None
        if fault is PostFault.STALL:
            self._faults.stall()
        return reply

    def _answer(self, request: Request) -> Reply | None:
        groups = tuple(dict.fromkeys(self._rate_groups(request)))
        self._count_request(self._request_key(request), groups)
        latency = self._faults.latency
        if latency:
            self._closing.wait(latency)
        pushed_back = self._push_back(groups)
        if pushed_back is not None:
            return pushed_back
        fault = self._faults.take_pre()
        if fault is PreFault.DROP:
            return None
        if isinstance(fault, Failure):
            return self._error(fault.status, fault.error, "injected failure", fault.retry_after)
        return self._route(request)

    def _push_back(self, groups: tuple[str, ...]) -> Reply | None:
        """The outage's 503 or a rate limit's 429, when one applies to this request of
        ``groups`` (its tenants)."""
        with self._lock:
            outage = self._outage
            if outage is not None:
                self._outage_requests += 1
            verdict = None if outage is not None else self._take_tokens(groups)
            if verdict is not None:
                self._throttled += 1
                self._group_throttled.update(groups)
        if outage is not None:
            after = None if math.isnan(outage) else outage
            return self._error(503, None, "The service is unavailable.", after)
        if verdict is not None:
            return self._rate_limited(*verdict)
        return None

    def _take_tokens(self, groups: tuple[str, ...]) -> tuple[float, int, int, int] | None:
        """A token from the server's bucket and each of ``groups``' (the caller holds the
        lock): None when all had one and each gave it; else the first refusal's figures
        for the 429, and no bucket gave a token."""
        now = time.monotonic()
        buckets = [] if self._limiter is None else [self._limiter]
        if self._group_rate is not None:
            rate = self._group_rate
            buckets += [self._group_limiters.setdefault(group, _TokenBucket(rate, now))
                        for group in groups]
        for bucket in buckets:
            verdict = bucket.refusal(now)
            if verdict is not None:
                return verdict
        for bucket in buckets:
            bucket.spend()
        return None

    def _request_key(self, request: Request) -> str | None:
        """The header a request's idempotency key travels in (providers differ)."""
        return request.header("Idempotency-Key")

    def _count_request(self, key: str | None, groups: tuple[str, ...]) -> None:
        with self._lock:
            self._total_requests += 1
            if key is not None:
                self._requests[key] += 1
            self._group_requests.update(groups)


class _TokenBucket:
    """``rate`` tokens a second, at most one second's worth held; not thread-safe (the
    provider's lock guards it)."""

    def __init__(self, rate: float, now: float) -> None:
        self.rate = rate
        self.capacity = max(1.0, rate)
        self.tokens = self.capacity
        self.at = now

    def refusal(self, now: float) -> tuple[float, int, int, int] | None:
        """Refill up to ``now``; None when a token is there (``spend()`` takes it), else
        (limit, remaining, retry-after, reset) for the 429, in whole seconds as providers
        send them. Takes nothing, so a request checked against several buckets takes
        from none of them when one refuses."""
        self.tokens = min(self.capacity, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1.0:
            return None
        retry_after = max(1, math.ceil((1.0 - self.tokens) / self.rate))
        reset = max(1, math.ceil((self.capacity - self.tokens) / self.rate))
        return self.rate, int(self.tokens), retry_after, reset

    def spend(self) -> None:
        """Take the token ``refusal`` found."""
        self.tokens -= 1.0


def _checked_rate(name: str, rate: float | None) -> float | None:
    """``rate`` as a float, None kept; ValueError for anything but a positive number."""
    if rate is None:
        return None
    if not (isinstance(rate, int | float) and rate > 0):
        raise ValueError(f"{name} must be a positive number, got {rate!r}")
    return float(rate)
