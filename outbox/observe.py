"""What a dispatcher tells the outside world: the ``DispatchObserver`` seam.

A dispatcher reports every event that metrics, tracing or logs could want to an
observer. The default observer does nothing, so a dispatcher without metrics pays one
method call per event. The counters a run returns (``DispatchStats``) are filled by an
observer of these events, the same ones the Prometheus metrics (``outbox-pg[prometheus]``)
hear; an application may add its own.

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

__all__ = ["AttemptOutcome", "DispatchObserver", "MultiObserver", "PurgedTable",
           "ReconnectingPart"]

AttemptOutcome = Literal["done", "retry", "failed", "reconcile", "released", "lost"]
"""How one attempt ended, as recorded (or not) in the database.

``done``/``retry``/``failed``/``reconcile``: the fenced settle wrote that state.
``released``: handed back unstarted at shutdown, its attempt refunded.
``lost``: the claim was gone when the outcome was written (a fence rejection) or when a
heartbeat ran; the later claim owns the job. Also an outcome the database refused to
record at all (the job is left to its lease; the rescuer's later claim owns it), and
the outcomes still unrecorded when a part of the dispatcher died.
"""

ReconnectingPart = Literal["claimer", "recorder"]
"""The dispatcher parts whose lost connection is reported (the listener, a hint only,
reconnects silently)."""

PurgedTable = Literal["jobs", "effect_results", "inbox"]
"""The tables retention deletes from: done jobs, the ledger, the inbox."""


class DispatchObserver:
    """Receives a dispatcher's events. Subclass and override what you need."""

    def effects_registered(self, effects: Sequence[str]) -> None:
        """The dispatcher this observer was given to (built with it, or through
        ``add_observer``) runs these effect names: every later ``effect`` argument is one
        of them. Lets a counter start at 0 for each effect and outcome, before its first
        event (so a rate over the first failures is not missed). Called on the thread
        that builds the dispatcher or adds the observer, before its runs' events."""

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

    # Events since the dispatcher counts ``DispatchStats`` from its events too. Each is
    # called once per batch (never per job), carrying a count.

    def recorded(self, outcome: AttemptOutcome, count: int) -> None:
        """The recorder wrote ``count`` outcomes of one batch as ``outcome``; ``lost``:
        their fenced write changed nothing (stale completions: the claim was gone). Every
        such job is also reported to ``attempt_finished``."""

    def claims_lost(self, count: int) -> None:
        """A heartbeat found ``count`` claims gone (their leases expired and were taken
        back); each is also reported to ``fence_rejected``."""

    def reconnected(self, part: ReconnectingPart) -> None:
        """``part``'s connection was lost; it reconnects (with backoff)."""

    def purged(self, table: PurgedTable, count: int) -> None:
        """Retention deleted ``count`` rows of ``table`` (one batch)."""

    def target_state(self, target: str, up: bool) -> None:
        """A dispatcher serving several targets (``Dispatcher(targets=...)``) found the
        target named ``target`` (``outbox.targets.Target.name``) reachable and served
        (``up``) or failing: refusing connections, missing its schema or a privilege,
        being migrated. Reported when it is first seen and at each change."""


class MultiObserver(DispatchObserver):
    """Forwards every event to several observers, in order."""

    def __init__(self, observers: Sequence[DispatchObserver]) -> None:
        self.observers = tuple(observers)

    def effects_registered(self, effects: Sequence[str]) -> None:
        for observer in self.observers:
            observer.effects_registered(effects)

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

    def recorded(self, outcome: AttemptOutcome, count: int) -> None:
        for observer in self.observers:
            observer.recorded(outcome, count)

    def claims_lost(self, count: int) -> None:
        for observer in self.observers:
            observer.claims_lost(count)

    def reconnected(self, part: ReconnectingPart) -> None:
        for observer in self.observers:
            observer.reconnected(part)

    def purged(self, table: PurgedTable, count: int) -> None:
        for observer in self.observers:
            observer.purged(table, count)

    def target_state(self, target: str, up: bool) -> None:
        for observer in self.observers:
            observer.target_state(target, up)
