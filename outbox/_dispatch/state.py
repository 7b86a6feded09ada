"""What the dispatcher's parts share, in one object with named transitions.

Who runs where (``Dispatcher``; ``AsyncDispatcher`` runs the same roles as tasks on one
event loop, with sync effects on a thread pool)::

    claimer    the caller's thread   hold(), start_draining(); waits on ``wake``
    workers    threads / the loop    begin(), finish(); hold a ``slots`` slot per perform
    recorder   its own thread        take_outcomes(), settled(), lose(), drop(); waits
                                     on ``outcome_ready``
    listener   its own thread        wakes the claimer (``wake``)
    dispatcher the caller's thread   workers_ended(), drop_unrecorded() (every part
                                     joined), reset() (between runs)
    anyone                           request_stop(), fail()

Fields are written through these transitions, except the moving average of perform
time, written in place by the workers, and the counters (``stats``), written only by
``counter`` from the events the parts report (``events``); each field says who writes
it. Reads from other threads are of single references or counters, safe under
the GIL, and every decision that depends on them is re-checked by a fenced statement in
the database.

The signals are ``threading.Event`` in ``Dispatcher`` (``ThreadState``) and ``LoopEvent``
in ``AsyncDispatcher`` (``AsyncState``), from ``signals`` with ``Slots`` and ``Timer``.
Every part runs supervised (``supervision``: ``supervising``, on a thread or as a
task): its unexpected death stops the dispatcher loudly
(``fail``). ``Held`` and the outcomes (``held``), the signals and the supervision are
re-exported here for the parts that take them all with the state.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from .. import tracing
from .._cancelling import Watch, signal_of
from ..errors import Throttled
from ..observe import AttemptOutcome, DispatchObserver, MultiObserver
from .budget import LimitView, is_transient
from .counting import DispatchStats, StatsObserver
from .held import Held, Outcome, Release, Success
from .signals import LoopEvent, Signal, Slots, Timer
from .supervision import guarded, supervised

__all__ = [
    "CLOSE_GRACE",
    "AsyncState",
    "Held",
    "LoopEvent",
    "Outcome",
    "Release",
    "SharedState",
    "Signal",
    "Slots",
    "Success",
    "ThreadState",
    "Timer",
    "guarded",
    "supervised",
]

log = logging.getLogger("outbox.dispatcher")
# Seconds a part gets to end once the drain is over (after stop_timeout: once what was
# held is left to its lease), before the stop goes on without it.
CLOSE_GRACE = 5.0


E = TypeVar("E", bound=Signal)


class SharedState(Generic[E]):
    """The jobs in hand, the outcomes to record, and the signals between the parts."""

    def __init__(
        self,
        stats: DispatchStats,
        observer: DispatchObserver,
        concurrency: int,
        event: Callable[[], E],
    ) -> None:
        # Claimed and not yet recorded, by job id. Added by the claimer (hold), removed
        # by the recorder (settled) or a worker (begin, for a claim already lost).
        self.held: dict[int, Held] = {}
        # Outcomes waiting for the recorder: appended by workers (finish), popped by the
        # recorder (take_outcomes). deque appends and pops are atomic.
        self.outcomes: deque[tuple[Held, Outcome]] = deque()
        # Set by workers when outcomes are queued and by the claimer while draining;
        # waited on and cleared by the recorder.
        self.outcome_ready: E = event()
        # Set by the listener (a notification), the recorder (room freed) and
        # request_stop(); waited on and cleared by the claimer.
        self.wake: E = event()
        # Set by request_stop(), fail() and workers_ended(); read by every loop as its
        # signal to end.
        self.stopping: E = event()
        # Set by request_stop() and start_draining(): workers hand unstarted jobs back.
        self.releasing = False
        # Set by workers_ended(): nothing more to record after what is queued.
        self.workers_done = False
        # Set by workers_ended() with workers_done: what the cancellation watcher waits
        # on between its sweeps, so that a run's end does not wait out a sweep's sleep.
        self.workers_ended_signal: E = event()
        # Set once by abandon(): stop_timeout passed with jobs still held; they are left
        # to their leases and whatever their performs return later is not recorded.
        self.abandoned = False
        # Set once by fail(): the first side part that died of an unexpected error.
        self.failure: BaseException | None = None
        # The concurrency limit, taken by workers around each perform.
        self.concurrency = concurrency
        self.slots = Slots(concurrency)
        # Moving average of perform time: written by workers (a lost update between
        # them is harmless), read by the claimer to size its claims.
        self.mean_perform_seconds: float | None = None
        # The user's observer, told of per-job events only when it is not the
        # do-nothing default (``observing``): they are the hot path.
        self.observer = observer
        self.observing = type(observer) is not DispatchObserver
        # The counters of this run, filled by ``counter`` from the batch events; the
        # parts send those to ``events``: the counter, then the user's observer.
        self.counter = StatsObserver(stats)
        self.events: DispatchObserver = (MultiObserver([self.counter, observer])
                                         if self.observing else self.counter)
        # What this process knows of the shared limit state (see ``limits``): read by
        # workers in begin, written by the claimer, the recorder and finish.
        self.limits = LimitView()
        # What the held jobs' ``job.cancelled`` signals share (outbox._cancelling):
        # renewed by the recorder's heartbeat, timeouts armed by the workers.
        self.watch = Watch()
        self._nothing_held()

    @property
    def stats(self) -> DispatchStats:
        """The counters of this run (written by ``counter`` only)."""
        return self.counter.stats

    @stats.setter
    def stats(self, stats: DispatchStats) -> None:
        self.counter.stats = stats

    # -- claimer ---------------------------------------------------------------------

    def hold(self, batch: list[Held]) -> None:
        """The claimer took ``batch``: it is ours until recorded."""
        for held in batch:
            self.held[held.job.id] = held

    def start_draining(self) -> None:
        """The claimer stops: jobs not started yet are handed back."""
        self.releasing = True
        self.outcome_ready.set()

    # -- workers ---------------------------------------------------------------------

    def begin(self, held: Held) -> bool:
        """A worker is about to perform ``held``: mark it started, or hand it back if it
        must not start (its claim is lost, or the dispatcher is stopping)."""
        if held.lost:
            self.held.pop(held.job.id, None)
            guarded(self.observer.attempt_finished, held.job.effect, "lost", 0.0)
            self.wake.set()
            return False
        if signal_of(held.job).is_set():  # told before it started: it never acts
            self.finish(held, Release())
            return False
        limits = self.limits
        if self.releasing or ((limits.paused_until or limits.local_until)
                              and limits.paused(held.job.effect)) or (
                limits.group_until and limits.group_paused(held.job.effect, held.job.group)):
            # Stopping, or the effect is paused (throttled, its breaker open, an
            # operator): hand the job back unstarted, its attempt refunded.
            self.finish(held, Release())
            return False
        held.started = True
        if held.traced:
            job = held.job
            held.span = tracing.attempt_span(job.id, job.effect, job.attempt, held.trace_context)
        if self.observing:
            guarded(self.observer.attempt_started, held.job.effect)
        return True

    def finish(self, held: Held, outcome: Outcome, *, signal: bool = True) -> None:
        """A worker is done with ``held``; the recorder will write ``outcome``. Threads
        running a run of fast jobs signal once per run (``signal=False`` before)."""
        if self.abandoned:
            return  # left to its lease at stop_timeout: the next claim decides
        if type(outcome) is not Success:
            self._pushed_back(held.job.effect, held.job.group, outcome)
        elif self.limits.local_failures:
            self.limits.local_failures.pop(held.job.effect, None)
        if held.span is not None and not isinstance(outcome, Success | Release):
            guarded(tracing.attempt_failed, held.span, outcome)
        self.outcomes.append((held, outcome))
        if signal:
            self.outcome_ready.set()

    def _pushed_back(self, effect: str, group: str | None, outcome: Outcome) -> None:
        """Stop starting ``effect``'s jobs (of ``group`` only, for an effect limited per
        group) here at once on a throttle, or on failures in a row past the breaker's
        threshold (the recorder then writes it for everyone)."""
        if isinstance(outcome, Throttled):
            self.limits.throttled_here(effect, outcome, group)
        elif is_transient(outcome):
            self.limits.failed_here(effect)

    # -- recorder --------------------------------------------------------------------

    def take_outcomes(self) -> list[tuple[Held, Outcome]]:
        """Everything the workers have finished so far."""
        taken = []
        while self.outcomes:
            taken.append(self.outcomes.popleft())
        return taken

    def settled(self, held: Held, outcome: AttemptOutcome) -> None:
        """The recorder wrote (or found fenced off) ``held``'s outcome: it is no longer
        ours, and its slot in the claimer's budget is free."""
        self.held.pop(held.job.id, None)
        if held.span is not None:
            guarded(tracing.settle, held.span, held.job.effect, outcome)
        if not self.observing:
            return
        if outcome == "lost":
            guarded(self.observer.fence_rejected, held.job.effect)
        guarded(self.observer.attempt_finished, held.job.effect, outcome, held.duration)

    def drop(self, held: Held, error: BaseException) -> None:
        """An outcome that cannot be written at all (``error``): give the job up to its
        lease (the rescuer retries it, counting the attempt). The attempt still reaches
        the observer (as ``lost``: a later claim owns the job) and its span ends."""
        self.held.pop(held.job.id, None)
        if held.span is not None:
            guarded(tracing.settle, held.span, held.job.effect, "lost", error)
        if self.observing:
            guarded(self.observer.attempt_finished, held.job.effect, "lost", held.duration)

    def drop_unrecorded(self) -> None:
        """The recorder has ended: drop every outcome it will never write (queued after
        a part died), so each attempt still reaches the observer and its span ends."""
        error = self.failure or RuntimeError("the recorder ended before this outcome")
        for held, _ in self.take_outcomes():
            try:
                self.drop(held, error)
            except BaseException:
                if self.failure is None:
                    raise
                # The observer raised past ``guarded`` (a BaseException): it is likely
                # what killed the part, and the run reports that death as
                # ``DispatcherFailed``. Raised again here, on the caller's thread, it
                # would replace that report; the rest are dropped without it.
                self.observing = False

    def abandon(self, stop_timeout: float, lease: float) -> None:
        """``stop_timeout`` passed after a stop with jobs still held. A job whose perform
        is still running is left to its lease, one line a job: never recorded as done
        nor handed back as unstarted (its perform may have acted); once the lease
        expires the rescuer gives it to another dispatcher, which performs it again with
        the same key. A job that never started (queued behind stuck performs: the drain
        lets none start) is handed back, and outcomes already queued are still written:
        the recorder gets a moment (``CLOSE_GRACE``) for both. What a perform returns
        from now on is not recorded."""
        self.abandoned = True
        queued = {id(held) for held, _ in list(self.outcomes)}
        for held in list(self.held.values()):
            job = held.job
            if id(held) in queued:
                continue  # performed: the recorder writes it
            if not held.started:
                self.outcomes.append((held, Release()))
                continue
            log.warning(
                "stop_timeout (%gs) passed: job %s (%s, key %r, claim %s) still performing; "
                "left to its lease, which ends within %gs of its last heartbeat; another "
                "dispatcher will perform it again", stop_timeout, job.id, job.effect, job.key,
                job.claim_version, lease)
            signal_of(job).tell("stop")
            self.drop(held, TimeoutError(f"stop_timeout ({stop_timeout}s) passed"))
        self.outcome_ready.set()
        self.wake.set()

    def lose(self, held: Held) -> None:
        """A heartbeat found ``held``'s claim gone: it must not start, and its outcome
        will be refused by the fence (the heartbeat reports ``claims_lost`` per batch)."""
        held.lost = True
        signal_of(held.job).tell("lost")
        if self.observing:
            guarded(self.observer.fence_rejected, held.job.effect)

    # -- the dispatcher ------------------------------------------------------------------

    def workers_ended(self) -> None:
        """Every worker has returned: the recorder ends once what is queued is written."""
        self.workers_done = True
        self.stopping.set()
        self.outcome_ready.set()
        self.workers_ended_signal.set()

    def reset(self) -> None:
        """Ready for the next run (the last one has joined every part)."""
        self.stopping.clear()
        self.wake.clear()
        self.outcome_ready.clear()
        self.workers_ended_signal.clear()
        self.releasing = False
        self.workers_done = False
        self.abandoned = False
        self.failure = None
        self.held.clear()
        self.outcomes.clear()
        self._nothing_held()
        self.slots = Slots(self.concurrency)  # nothing can be waiting after a join

    def _nothing_held(self) -> None:
        """Nothing is held: every lease held is renewed now, as a heartbeat would say,
        so the cancellation watcher does not check each held job's lease at every sweep
        until the first heartbeat (a lease runs from its claim, which comes later). Left
        at its start (no heartbeat yet), the watcher walked every job held ten times a
        second for the first third of a lease: 0.3 to 0.5 µs of CPU a job of a drain."""
        self.watch.renewed = max(self.watch.renewed, time.monotonic())

    # -- anyone ----------------------------------------------------------------------

    def request_stop(self) -> None:
        """Stop claiming; hand back what has not started; finish the rest."""
        self.releasing = True
        self.stopping.set()
        self.wake.set()

    def fail(self, part: str, error: BaseException) -> None:
        """``part`` died of an unexpected error: stop the dispatcher, loudly."""
        log.critical("dispatcher %s died of an unexpected error; stopping the dispatcher",
                     part, exc_info=error)
        if self.failure is None:
            self.failure = error
        self.request_stop()
        self.outcome_ready.set()


# The state as each dispatcher shares it: ``Dispatcher``'s threads signal with
# ``threading.Event``, ``AsyncDispatcher``'s tasks with ``LoopEvent``.
ThreadState = SharedState[threading.Event]
AsyncState = SharedState[LoopEvent]
