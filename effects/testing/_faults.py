"""Fault injection shared by the fake providers: thread-safe, one-shot counts."""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Collection
from dataclasses import dataclass
from enum import Enum

__all__ = ["Failure", "Faults", "Hold", "PostFault", "PreFault", "fault_kind"]


@dataclass(frozen=True)
class Failure:
    """Answer one request with ``status`` before doing anything (nothing is performed)."""

    status: int
    retry_after: float | None = None
    error: str | None = None


class PreFault(Enum):
    """What happens to a request before it is performed."""

    DROP = "drop"  # close the connection without answering; nothing performed


class PostFault(Enum):
    """What happens to a request after it was performed and its response saved."""

    STALL = "stall"  # hold the response until released (past the client's timeout)
    DROP = "drop"  # close the connection without answering


class Hold:
    """A request held after its idempotency key was taken, before it is performed.

    While held, the key is "in flight": a second request with it gets the provider's
    in-flight 409. ``arrived`` is set when the request reaches the hold, so a test can
    wait for it instead of sleeping; ``release()`` lets it go on.
    """

    def __init__(self) -> None:
        self.arrived = threading.Event()
        self._released = threading.Event()

    def release(self) -> None:
        """Let the held request be performed."""
        self._released.set()

    def wait_for_arrival(self, timeout: float = 10.0) -> None:
        """Block until the held request has arrived; AssertionError after ``timeout``."""
        if not self.arrived.wait(timeout):
            raise AssertionError(f"no request reached the hold within {timeout} s")

    def _block(self, timeout: float) -> None:
        self.arrived.set()
        self._released.wait(timeout)


class Faults:
    """The faults armed on one fake. Every count is consumed by one request, once."""

    def __init__(self, *, latency: float = 0.0, max_stall: float = 60.0) -> None:
        self._lock = threading.Lock()
        self._latency = latency
        self._max_stall = max_stall
        self._failures: deque[Failure] = deque()
        self._drops = 0
        self._post_faults: deque[PostFault] = deque()
        self._holds: deque[Hold] = deque()
        self._active_holds: list[Hold] = []
        self._stall_release = threading.Event()
        self._stalled = threading.Condition(self._lock)
        self._stalled_count = 0
        self._closed = False
        self._met: Counter[str] = Counter()  # by fault_kind: armed faults a request met

    @property
    def latency(self) -> float:
        """Seconds every request waits before it is handled."""
        with self._lock:
            return self._latency

    def set_latency(self, seconds: float) -> None:
        """Delay every following request by ``seconds`` (0 to stop)."""
        if seconds < 0:
            raise ValueError("latency must not be negative")
        with self._lock:
            self._latency = seconds

    def fail_next(self, n: int, failure: Failure) -> None:
        """The next ``n`` requests are answered with ``failure``, nothing performed."""
        with self._lock:
            self._failures.extend([failure] * _count(n))

    def drop_connection(self, n: int) -> None:
        """The next ``n`` requests are read, then their connection closed unanswered."""
        with self._lock:
            self._drops += _count(n)

    def after_perform(self, n: int, fault: PostFault) -> None:
        """The next ``n`` performed requests get ``fault`` instead of a timely answer."""
        with self._lock:
            self._post_faults.extend([fault] * _count(n))

    def hold_next(self) -> Hold:
        """Hold the next request that takes an idempotency key; see ``Hold``."""
        hold = Hold()
        with self._lock:
            self._holds.append(hold)
        return hold

    def release_stalled(self) -> None:
        """Let every stalled response go out now; later stalls wait again."""
        with self._lock:
            release, self._stall_release = self._stall_release, threading.Event()
        release.set()

    def close(self) -> None:
        """Release everything waiting and stop stalling or holding (the fake is closing)."""
        with self._lock:
            self._closed = True
        self._release_waiting()

    def disarm_pending(self, keep: Collection[str] = ()) -> int:
        """Disarm the failures, drops and post-perform faults no request has met yet,
        except those whose ``fault_kind`` is in ``keep``; how many were disarmed.
        Latency, holds and stalled answers stay."""
        with self._lock:
            failures = [f for f in self._failures if fault_kind(f) in keep]
            posts = [f for f in self._post_faults if fault_kind(f) in keep]
            drops = self._drops if fault_kind(PreFault.DROP) in keep else 0
            pending = len(self._failures) + self._drops + len(self._post_faults)
            self._failures = deque(failures)
            self._drops = drops
            self._post_faults = deque(posts)
        return pending - len(failures) - len(posts) - drops

    def met(self, kind: str) -> int:
        """How many armed faults of ``kind`` (a ``fault_kind``) requests have met."""
        with self._lock:
            return self._met[kind]

    def clear(self) -> None:
        """Disarm everything and release whatever is waiting."""
        self._release_waiting()
        with self._lock:
            self._latency = 0.0
            self._failures.clear()
            self._drops = 0
            self._post_faults.clear()
            self._stalled_count = 0

    def _release_waiting(self) -> None:
        with self._lock:
            holds = [*self._holds, *self._active_holds]
            self._holds.clear()
            self._active_holds.clear()
        for hold in holds:
            hold.release()
        self.release_stalled()

    def take_pre(self) -> PreFault | Failure | None:
        """The fault for a request about to be handled: a drop first, then a failure."""
        with self._lock:
            fault: PreFault | Failure | None = None
            if self._drops:
                self._drops -= 1
                fault = PreFault.DROP
            elif self._failures:
                fault = self._failures.popleft()
            if fault is not None:
                self._met[fault_kind(fault)] += 1
            return fault

    def take_post(self) -> PostFault | None:
        """The fault for a request that was just performed."""
        with self._lock:
            if not self._post_faults:
                return None
            fault = self._post_faults.popleft()
            self._met[fault_kind(fault)] += 1
            return fault

    def hold_if_armed(self) -> None:
        """Block the calling request on the next armed hold, if any."""
        with self._lock:
            if self._closed or not self._holds:
                return
            hold = self._holds.popleft()
            self._active_holds.append(hold)
        hold._block(self._max_stall)
        with self._lock:
            if hold in self._active_holds:
                self._active_holds.remove(hold)

    def stall(self) -> None:
        """Block the calling request until stalls are released (at most ``max_stall``)."""
        with self._lock:
            if self._closed:
                return
            release = self._stall_release
            self._stalled_count += 1
            self._stalled.notify_all()
        release.wait(self._max_stall)

    def wait_for_stalls(self, n: int, timeout: float) -> None:
        """Block until ``n`` answers in all have been stalled; AssertionError on timeout."""
        with self._lock:
            if not self._stalled.wait_for(lambda: self._stalled_count >= n, timeout):
                raise AssertionError(f"{n} stalled answer(s) expected within {timeout} s")


def fault_kind(fault: Failure | PreFault | PostFault) -> str:
    """The kind a one-shot fault is counted and kept by: ``"429"`` and ``"failure"``
    (any other status) answered before performing, ``"drop"`` before performing,
    ``"stall"`` and ``"post_drop"`` after."""
    if isinstance(fault, Failure):
        return "429" if fault.status == 429 else "failure"
    if isinstance(fault, PreFault):
        return "drop"
    return "stall" if fault is PostFault.STALL else "post_drop"


def _count(n: int) -> int:
    if n < 1:
        raise ValueError(f"a fault count must be at least 1, got {n}")
    return n
