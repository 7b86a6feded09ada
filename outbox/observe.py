"""What a dispatcher tells the outside world: the ``DispatchObserver`` seam.

A dispatcher reports every event that metrics, tracing or logs could want to an
observer. The default observer does nothing, so a dispatcher without metrics pays one
method call per event. ``DispatchStats`` counting, the Prometheus metrics
(``outbox[prometheus]``) and tracing are observers; an application may add its own.

Contract for implementers:

- Methods are called from the dispatcher's own threads (or its event loop for
  ``AsyncDispatcher``), possibly from several at once: they must be thread-safe, cheap
  and must not block on I/O.
- They must not raise. An exception from an observer is logged by the dispatcher and
  otherwise ignored: observing never changes what happens to a job.
- Arguments never include payloads, keys or error text, so an observer cannot leak them
  by accident. ``effect`` is always one of the dispatcher's registered effect names.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

__all__ = ["AttemptOutcome", "DispatchObserver", "MultiObserver"]

AttemptOutcome = Literal["done", "retry", "failed", "reconcile", "released", "lost"]
"""How one attempt ended, as recorded (or not) in the database.

``done``/``retry``/``failed``/``reconcile``: the fenced settle wrote that state.
``released``: handed back unstarted at shutdown, its attempt refunded.
``lost``: the claim was gone when the outcome was written (a fence rejection) or when a
heartbeat ran; the later claim owns the job.
"""


class DispatchObserver:
    """Receives a dispatcher's events. Subclass and override what you need."""

    def claimed(self, duration: float, waits: Sequence[tuple[str, float]]) -> None:
        """A claim statement finished after ``duration`` seconds.

        ``waits`` has one ``(effect, seconds)`` per job claimed: how long it had been due
        (``claimed_at - available_at``). Empty when the claim found nothing.
        """

    def attempt_started(self, effect: str) -> None:
        """``perform`` is about to run for one job of ``effect``."""

    def attempt_finished(self, effect: str, outcome: AttemptOutcome, duration: float) -> None:
        """One attempt ended with ``outcome``; ``duration`` is the seconds ``perform`` ran
        (0 for a job released unstarted)."""

    def fence_rejected(self, effect: str) -> None:
        """A fenced write (settle or heartbeat) about a job of ``effect`` changed 0 rows."""

    def rescued(self, count: int) -> None:
        """The rescuer took back ``count`` jobs whose leases had expired."""


class MultiObserver(DispatchObserver):
    """Forwards every event to several observers, in order."""

    def __init__(self, observers: Sequence[DispatchObserver]) -> None:
        self.observers = tuple(observers)

    def claimed(self, duration: float, waits: Sequence[tuple[str, float]]) -> None:
        for observer in self.observers:
            observer.claimed(duration, waits)

    def attempt_started(self, effect: str) -> None:
        for observer in self.observers:
            observer.attempt_started(effect)

    def attempt_finished(self, effect: str, outcome: AttemptOutcome, duration: float) -> None:
        for observer in self.observers:
            observer.attempt_finished(effect, outcome, duration)

    def fence_rejected(self, effect: str) -> None:
        for observer in self.observers:
            observer.fence_rejected(effect)

    def rescued(self, count: int) -> None:
        for observer in self.observers:
            observer.rescued(count)
