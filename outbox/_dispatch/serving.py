"""A dispatcher's run, written once for both flavours: ``serve``, a program of
``runtime`` that states in which order a run's parts start and end, and the rules of its
stop; each flavour's ``Flavour`` carries out what it does its own way.

One run (``serve``)::

    begin      under the lock ``stop()`` takes: one run at a time, a stop that came
               between runs taken by this one, the stop watch started
    prepare    the schema is current (waited for while unreachable), the role's access
    serving    the parts started, the claimer run on the caller's thread or task, the
               drain, the parts joined (below)
    returned   the stop watch ends, the claimer's connection goes, the run is over
    surfaced   a part that died: ``DispatcherFailed`` (a ``ConfigurationError``: as is)

The parts (``serving``), in this order::

    reconciler, scheduler  under ``run_until_idle`` one pass each before any part runs
                           (the scheduler's on the claimer's connection); under ``run``
                           parts of their own
    recorder, cancellation watcher, listener (``run`` only), workers
    claimer                its loop (``claimer.claiming``), then its connection goes
    wind-down              the drain (``draining``); the workers joined; the recorder
                           joined (after ``stop_timeout``: with a grace)
    the rest               the watcher, listener, reconciler, scheduler ended, each
                           within a grace; outcomes nobody will write dropped

Every part runs supervised (``supervision.supervising``): its unexpected death stops the
run, which then raises ``DispatcherFailed``; a pass before claiming is supervised the
same way. What differs by flavour is only what the ``Flavour`` does: threads or tasks, how
a part is ended (a thread ends at the stop it watches; a task is cancelled), where the
stop watch's program runs (``severance.StopWatch``: a thread, a task), the replica gate,
and asyncio's cancellation (the first drains, a second abandons: the wind-down is skipped
and every part cancelled).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from threading import RLock
from typing import Any, Protocol

from ..errors import ConfigurationError, DispatcherFailed
from ..schedules import Schedule
from .cancellation import watching
from .claimer import Claimer, claiming
from .connection import AsyncConnection, Connection
from .counting import DispatchStats
from .listener import listening
from .reconciler import Reconciler, reconcilers, reconciling
from .recorder import Recorder, recording
from .runtime import Call, Program, Wait
from .scheduler import Scheduler, scheduling
from .settings import Settings
from .shared import held
from .state import CLOSE_GRACE, Held, SharedState
from .supervision import supervising

__all__ = ["DRAIN_CHECK", "PARTS", "Flavour", "Serves", "draining", "serve", "serving"]

DRAIN_CHECK = 0.05  # seconds between checks that every held job is recorded
PARTS = ("reconciler", "scheduler", "recorder", "cancellation watcher", "listener")
"""The parts beside the claimer and the workers, in the order they start."""
# A pass run on the caller's own thread or task: its interruptions are the caller's.
INTERRUPTIONS = (asyncio.CancelledError, KeyboardInterrupt)

Submit = Callable[[list[Held]], None]


class Flavour(Protocol):
    """What a flavour of dispatcher does its own way in one run (``Dispatcher``'s on
    threads, ``AsyncDispatcher``'s as tasks). A method may answer an awaitable: the
    program yields it as a ``Call``, which ``drive_async`` awaits."""

    watch: Any  # the stop watch: ``claimer_left``, ``deadline``, ``grace``

    @property
    def claimer(self) -> Connection | AsyncConnection:
        """The claimer's connection."""

    def begin(self) -> SharedState[Any]:
        """Under the run's lock: the run's state (counters new), its stop watch
        (``severance.StopWatch``) started."""

    def prepare(self, state: SharedState[Any], deadline: float | None) -> Any:
        """The schema waited for, the role's access checked."""

    def connection(self, role: str) -> Connection | AsyncConnection:
        """A new connection of ``role`` (opened when first used)."""

    def hooks_apart(self) -> Connection | None:
        """Where plain hooks write when the flavour's connections cannot run them."""

    def start(self, part: str, program: Program[None]) -> Any:
        """``program`` run supervised beside the caller; a handle to ``join``/``end``."""

    def join(self, handle: Any, grace: float | None) -> Any:
        """Wait for the part to end by itself, at most ``grace`` seconds (None: without
        end); one still running then is left behind (a task: cancelled)."""

    def end(self, handle: Any, grace: float) -> Any:
        """The part is no longer needed: ended (a task cancelled; a thread, which ends
        at the stop it watches, joined), waited for at most ``grace``."""

    def workers(self) -> Submit:
        """The workers started; what hands them a batch of claimed jobs."""

    def gate(self, submit: Submit) -> Submit:
        """``submit`` behind the replica gate (``wait_for_replicas``)."""

    def join_workers(self) -> Any:
        """Wait for the workers (after ``stop_timeout``: what still performs is told to
        stop and given a moment)."""

    def end_workers(self) -> Any:
        """The workers, abandoned: what still runs is left to its leases."""

    def abandons(self, error: BaseException) -> bool:
        """Whether ``error``, raised from the claimer's loop, abandons the wind-down."""

    def close(self) -> Any:
        """Every part has ended: what the workers and the gate still hold is let go."""

    def returned(self) -> Any:
        """The run is over: the stop watch ends."""

    def finish(self, state: SharedState[Any]) -> None:
        """Under the run's lock: ready for the next run."""


class Serves(Protocol):
    """What ``serve`` reads of a dispatcher."""

    settings: Settings
    stats: DispatchStats
    schedules: tuple[Schedule, ...]
    _running: bool
    _stop_early: bool
    _control: RLock
    _schedule_clock: Callable[[], Any] | None

    def _dispatch(self, flavour: Flavour, state: SharedState[Any], until_idle: bool,
                  deadline: float | None) -> Program[None]: ...

    def _failed(self, failure: BaseException) -> DispatcherFailed: ...


def serve(dispatcher: Serves, flavour: Flavour, *, until_idle: bool,
          deadline: float | None) -> Program[DispatchStats]:
    """One run of ``dispatcher`` (``run`` or ``run_until_idle``): its counters, or
    ``DispatcherFailed`` (a ``ConfigurationError`` as is) when a part died."""
    with dispatcher._control:  # checked and set at once: two runs cannot both start
        if dispatcher._running:
            raise ConfigurationError(f"this {type(dispatcher).__name__} is already running")
        # Under the lock stop() takes: either stop() came first (and this run stops at
        # once) or it finds this run's state; nothing in between for it to fall into.
        state = flavour.begin()
        if dispatcher._stop_early:
            dispatcher._stop_early = False  # taken by this run: the next starts afresh
            state.request_stop()
        dispatcher._running = True
    try:
        with held(dispatcher.settings.limits_home):
            yield Call(flavour.prepare, state, deadline)
            yield from dispatcher._dispatch(flavour, state, until_idle, deadline)
        failure = state.failure
    finally:
        yield Call(flavour.returned)
        yield Call(flavour.claimer.discard)  # gone already, unless the run never claimed
        with dispatcher._control:
            flavour.finish(state)
            dispatcher._running = False
    if isinstance(failure, ConfigurationError):
        raise failure  # the set-up is wrong, not the code: say what is wrong
    if failure is not None:
        raise dispatcher._failed(failure) from failure
    return dispatcher.stats


def serving(dispatcher: Serves, flavour: Flavour, state: SharedState[Any],
            until_idle: bool, deadline: float | None) -> Program[None]:
    """The parts started, the claimer run, the wind-down and the parts ended, in the
    order the module's docstring gives (``Dispatcher._dispatch``, and
    ``AsyncDispatcher``'s, are this)."""
    settings = dispatcher.settings
    scheduler = Scheduler(settings, state, dispatcher.schedules, dispatcher._schedule_clock)
    reconciler = Reconciler(settings, state) if reconcilers(settings) else None
    if until_idle:
        # Before any part runs: what the reconciler sends back to pending, and the slots
        # the scheduler enqueues, are performed in this run; a pass that dies stops it.
        if reconciler is not None:
            yield from supervising(state, "reconciler", reconciling(
                reconciler, flavour.connection("reconciler"), once=True,
                blocking=flavour.hooks_apart()), INTERRUPTIONS)
        yield from supervising(state, "scheduler", scheduling(
            scheduler, flavour.claimer, once=True), INTERRUPTIONS)
    side: list[Any] = []  # the parts ended once the recorder is done
    recorder: Any = None
    wound_down = False
    try:
        if not until_idle:
            if reconciler is not None:
                side.append((yield Call(flavour.start, "reconciler", reconciling(
                    reconciler, flavour.connection("reconciler"), once=False,
                    blocking=flavour.hooks_apart()))))
            side.append((yield Call(flavour.start, "scheduler", scheduling(
                scheduler, flavour.connection("scheduler"), once=False))))
        recorder = yield Call(flavour.start, "recorder", recording(
            Recorder(settings, state), flavour.connection("recorder")))
        side.append((yield Call(flavour.start, "cancellation watcher",  # timeouts, leases
                                watching(state, settings.lease))))
        if not until_idle:
            side.append((yield Call(flavour.start, "listener", listening(
                settings, state, flavour.connection("listener")))))
        submit = yield Call(flavour.workers)
        abandon = False
        try:  # with wait_for_replicas, each batch waits for the standbys
            yield from claiming(Claimer(settings, state, until_idle=until_idle),
                                flavour.claimer, flavour.gate(submit), deadline)
        except BaseException as exc:
            abandon = flavour.abandons(exc)
            raise
        finally:
            flavour.watch.claimer_left()
            yield Call(flavour.claimer.discard)
            if not abandon:
                yield from draining(state, settings, flavour.watch.deadline())
                yield Call(flavour.join_workers)
                state.workers_ended()
                # After stop_timeout the recorder has nothing left to write, but it may
                # be waiting on an unreachable database: the stop does not wait for it.
                yield Call(flavour.join, recorder,
                           flavour.watch.grace(CLOSE_GRACE) if state.abandoned else None)
                wound_down = True
    finally:
        if not wound_down:  # abandoned: what still runs is left to its leases
            yield Call(flavour.end_workers)
            state.workers_ended()
            if recorder is not None:
                yield Call(flavour.end, recorder, flavour.watch.grace(CLOSE_GRACE))
        for part in side:
            yield Call(flavour.end, part, flavour.watch.grace(CLOSE_GRACE))
        yield Call(flavour.close)
        state.drop_unrecorded()  # a part died: what it will never write still counts


def draining(state: SharedState[Any], settings: Settings, deadline: float) -> Program[None]:
    """The drain: stop claiming; release queued jobs; wait until every held job is
    recorded (unless a part died: then what it held is left to the rescuer) until
    ``deadline`` (``stop_timeout`` from the stop): what is still held then is left to
    its lease."""
    state.start_draining()
    while (state.held and state.failure is None and not state.abandoned
           and time.monotonic() < deadline):
        state.outcome_ready.set()
        yield Wait(state.wake, DRAIN_CHECK)
        state.wake.clear()
    if state.held and state.failure is None and not state.abandoned:
        state.abandon(settings.stop_timeout, settings.lease)
