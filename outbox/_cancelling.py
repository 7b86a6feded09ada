"""``job.cancelled``: the event a perform reads to learn that it must stop acting.

A ``threading.Event`` (``CancelSignal``) made per claim, set once, with the first reason
it was told (``reason``):

- ``"operator"``: an operator cancelled the running job (``outbox cancel``, the dashboard);
- ``"lost"``: the dispatcher's heartbeat found its claim taken over (the fence moved on);
- ``"lease"``: its lease could not be renewed before it expired;
- ``"timeout"``: the effect's ``timeout`` passed since the perform started;
- ``"stop"``: ``stop_timeout`` passed after a stop;
- ``"set"``: something else called ``set()`` (the effect itself, a test).

The lease and the timeout are clocks: ``is_set()`` and ``wait()`` compare them with the
monotonic clock themselves, so a perform that was paused (SIGSTOP, a long GC pause) past
its lease learns it at its very next check, before the dispatcher's watcher has run. The
watcher (``outbox._dispatch.cancellation``) sets the event on time for performs that
block in ``wait()`` and cancels async performs' tasks.

No I/O: the dispatcher's parts feed it (the heartbeat's renewals, a notification).
"""

from __future__ import annotations

import asyncio
import heapq
import math
import threading
import time
from typing import TYPE_CHECKING, Literal, cast

if TYPE_CHECKING:
    from .effect import Job

__all__ = ["CancelSignal", "Reason", "Watch", "signal_of"]

Reason = Literal["operator", "lost", "lease", "timeout", "stop", "set"]

_MAKING = threading.Lock()  # guards the lazy creation of an event's condition


class Watch:
    """What one dispatcher's signals share: when its leases were last renewed, and the
    timeouts armed, earliest first, for the watcher to set on time."""

    __slots__ = ("_armed", "_lock", "renewed")

    def __init__(self) -> None:
        # Monotonic time at which the last heartbeat that renewed every lease held was
        # sent (so its leases run at least until ``renewed + lease``); written by the
        # recorder, read by every signal.
        self.renewed = -math.inf
        self._armed: list[tuple[float, int, CancelSignal]] = []
        self._lock = threading.Lock()

    def arm(self, deadline: float, signal: CancelSignal) -> None:
        """Have the watcher tell ``signal`` at ``deadline`` (monotonic)."""
        with self._lock:
            heapq.heappush(self._armed, (deadline, id(signal), signal))

    def due(self, now: float) -> list[CancelSignal]:
        """The signals whose timeout has passed by ``now`` (each returned once)."""
        found = []
        with self._lock:
            while self._armed and self._armed[0][0] <= now:
                found.append(heapq.heappop(self._armed)[2])
        return found

    def overdue(self, now: float, lease: float) -> bool:
        """Whether leases renewed last at ``renewed`` may have expired by ``now``."""
        return now >= self.renewed + lease


class CancelSignal(threading.Event):
    """``job.cancelled``: set when the job's perform must stop acting (see the module
    docstring for the reasons, in ``reason``). Its condition is made on first use, so
    a claim that is never waited on costs no lock."""

    __slots__ = ("_deadline", "_lease", "_made", "_since", "_task", "_timeout",
                 "_watch", "reason")

    def __init__(self, watch: Watch | None = None, lease: float = math.inf,
                 timeout: float | None = None) -> None:
        # Not Event.__init__: its Condition is made lazily (``_cond``).
        self._flag = False
        self._made: threading.Condition | None = None
        self.reason: Reason | None = None
        self._watch = watch
        self._lease = lease
        self._since = time.monotonic() if watch is not None else 0.0
        self._timeout = timeout
        self._deadline = math.inf
        self._task: asyncio.Task[object] | None = None

    @property
    def _cond(self) -> threading.Condition:
        made = self._made
        if made is None:
            with _MAKING:
                made = self._made
                if made is None:
                    made = self._made = threading.Condition(threading.Lock())
        return made

    def is_set(self) -> bool:
        """True once the perform must stop (its lease or timeout is checked now)."""
        if self._flag:
            return True
        return self.check(time.monotonic())

    def wait(self, timeout: float | None = None) -> bool:
        """As ``threading.Event.wait``; a lease or timeout passed counts as set."""
        if super().wait(timeout):
            return True
        return self.is_set()

    def set(self) -> None:
        """Set the event (reason ``"set"`` unless told one) and cancel the async
        perform's task, if one is running."""
        if self.reason is None:
            self.reason = "set"
        super().set()
        task = self._task
        if task is not None:
            task.get_loop().call_soon_threadsafe(self._cancel, task)

    def tell(self, reason: Reason) -> None:
        """Set the event for ``reason`` (the first reason told is kept)."""
        if self.reason is None:
            self.reason = reason
        self.set()

    def check(self, now: float) -> bool:
        """Set the event if its timeout or its lease has passed by ``now``."""
        if now >= self._deadline:
            self.tell("timeout")
            return True
        watch = self._watch
        if watch is not None and now >= max(self._since, watch.renewed) + self._lease:
            self.tell("lease")
            return True
        return False

    def started(self, task: asyncio.Task[object] | None = None) -> None:
        """The perform starts (``task``: the task awaiting an async perform, cancelled
        when the event is set): its timeout, if any, runs from now."""
        self._task = task
        if self._timeout is not None:
            self._deadline = time.monotonic() + self._timeout
            if self._watch is not None:
                self._watch.arm(self._deadline, self)
        if self._flag and task is not None:  # told before it started
            task.get_loop().call_soon(self._cancel, task)

    def ended(self) -> None:
        """The perform has returned or raised: its task is no longer to be cancelled."""
        self._task = None

    def _cancel(self, task: asyncio.Task[object]) -> None:
        # On the task's loop: only while that very perform is still awaited (the task
        # serves one job after another).
        if self._task is task:
            task.cancel()


def signal_of(job: Job) -> CancelSignal:
    """``job.cancelled`` as the ``CancelSignal`` every ``Job`` is made with."""
    return cast(CancelSignal, job.cancelled)
