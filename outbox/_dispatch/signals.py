"""The primitives the dispatcher's parts wait and limit with: a periodic ``Timer``, the
``Signal`` protocol (``threading.Event`` in ``Dispatcher``, ``LoopEvent`` in
``AsyncDispatcher``) and ``Slots``, the one concurrency limit shared by threads and tasks.
No I/O, no knowledge of jobs."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["LoopEvent", "Signal", "Slots", "Timer"]


@dataclass
class Timer:
    """Due every ``interval`` seconds of the monotonic clock."""

    interval: float
    next_at: float = field(default=0.0)

    def due(self, now: float) -> bool:
        if now < self.next_at:
            return False
        self.next_at = now + self.interval
        return True

    def again_in(self, now: float, delay: float) -> None:
        """Be due ``delay`` seconds from ``now`` (sooner than the interval would say)."""
        self.next_at = min(self.next_at, now + delay)


class Signal(Protocol):
    """An event one part sets and another waits on (``threading.Event``, or the event
    loop's equivalent in ``AsyncDispatcher``)."""

    def set(self) -> None: ...

    def clear(self) -> None: ...

    def is_set(self) -> bool: ...


class LoopEvent:
    """A ``threading.Event`` look-alike for one event loop (``AsyncDispatcher``'s
    ``Signal``): ``set`` from any thread (so ``stop()`` and sync effects' threads can
    signal), waited on by tasks."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()
        self._event = asyncio.Event()
        self._flag = False

    def set(self) -> None:
        if self._flag:  # already set (workers set it once per job: keep that cheap)
            return
        self._flag = True
        if threading.get_ident() == self._thread:
            self._event.set()
        elif not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._event.set)

    def clear(self) -> None:
        self._flag = False
        self._event.clear()

    def is_set(self) -> bool:
        return self._flag

    async def wait(self, seconds: float) -> bool:
        """Wait until set or ``seconds`` passed; return whether it is set."""
        if not self._event.is_set():
            try:
                async with asyncio.timeout(seconds):
                    await self._event.wait()
            except TimeoutError:
                pass
        return self._flag


class Slots:
    """The one concurrency limit: at most ``limit`` performs at once, sync and async
    together. A thread blocks in ``acquire``; a job for the event loop is started by
    ``when_free`` once it holds a slot (no task exists while it waits). Waiters are
    served in arrival order whichever kind they are, so neither starves the other."""

    def __init__(self, limit: int) -> None:
        self._lock = threading.Lock()
        self._free = limit  # under _lock
        self._waiters: deque[Callable[[], None]] = deque()  # under _lock; each takes a slot

    @property
    def waiting(self) -> int:
        """How many performs wait for a slot now."""
        return len(self._waiters)

    def acquire(self) -> None:
        """Take a slot, blocking the calling thread until one is free."""
        handed = threading.Event()
        if not self._take_or_queue(handed.set):
            handed.wait()

    def when_free(self, start: Callable[[], None]) -> None:
        """Call ``start`` holding a slot: now if one is free, else from the ``release``
        that frees one (on the releasing thread: ``start`` must be thread-safe)."""
        if self._take_or_queue(start):
            start()

    def _take_or_queue(self, waiter: Callable[[], None]) -> bool:
        with self._lock:
            if self._free and not self._waiters:
                self._free -= 1
                return True
            self._waiters.append(waiter)
            return False

    def release(self) -> None:
        """Give a slot back: to the longest waiter, else to the pool."""
        waiter = self.pass_on()
        if waiter is not None:
            waiter()

    def pass_on(self) -> Callable[[], None] | None:
        """Give a slot back as ``release`` does, except that the longest waiter is
        returned instead of called: the caller hands it the slot it holds (by calling it,
        or by running that waiter's job itself)."""
        with self._lock:
            if not self._waiters:
                self._free += 1
                return None
            return self._waiters.popleft()
