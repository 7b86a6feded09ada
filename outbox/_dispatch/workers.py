"""The workers: run ``perform`` for claimed jobs, at most ``concurrency`` at once.

``Performer`` holds what both dispatchers do around one ``perform`` (the slot, the start
check, payload validation, timing, turning the result or the exception into an outcome).
``ThreadWorkers`` is ``Dispatcher``'s pool: sync effects on at most ``concurrency``
threads fed by one queue (a ``DaemonPool``), async effects as ``TaskWorkers`` on one event
loop of its own (``LoopRunner``). ``TaskWorkers`` are all of ``AsyncDispatcher``'s
workers, on its loop (sync effects through a ``DaemonPool`` too). The one limit across
all of them is ``SharedState.slots``.

Nothing is started before there is work for it: a run's threads start as its jobs come
(one at a time, only while work waits that no thread already started is idle to take),
and its event loop with its first async job. A run that claims nothing starts no worker
at all; one that claims three slow jobs starts three threads, not ``concurrency``; a
run of a few quick ones, the few threads that start while they last.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from contextlib import contextmanager
from functools import partial
from queue import SimpleQueue
from typing import Any, ParamSpec, TypeVar

from pydantic import BaseModel, ValidationError

from .. import tracing
from .._cancelling import signal_of
from .._enqueue import jsonb_problem
from ..effect import Job
from ..errors import Permanent
from .crew import Started, start_thread, turn_share
from .held import Undecodable
from .settings import Settings
from .state import Held, Outcome, SharedState, Success, supervised

__all__ = ["DaemonPool", "LoopRunner", "Performer", "TaskWorkers", "ThreadWorkers"]

log = logging.getLogger("outbox.dispatcher")

FAST_EFFECT = 0.001  # seconds: effects faster than this are handed to threads in runs
MAX_RUN = 256  # jobs in one run at most: what one perform that stalls holds up
RUN_SECONDS = 0.002  # of measured perform time in one run at least, when there are enough
# Seconds the workers still running after stop_timeout (told to stop) get to end, all
# together, before the stop goes on without them.
STUCK_GRACE = 0.5
# The outcome of every perform that returned None (most do): one object for all, never
# changed, rather than one more for the collector to count per job.
RETURNED_NONE = Success("null")


class Performer:
    """Runs one ``perform`` and turns what happened into an outcome. Thread-safe."""

    def __init__(self, state: SharedState[Any]) -> None:
        self.state = state

    def perform_sync(self, held: Held, *, signal: bool = True, gated: bool = True) -> None:
        """On a worker thread: wait for a slot, then perform ``held`` (or hand it back).
        ``gated=False`` where the threads alone are the limit (no async effects)."""
        state = self.state
        if (state.releasing or held.lost) and not state.begin(held):
            return  # handed back or dropped without waiting for a slot
        if not gated:
            if state.begin(held):
                state.finish(held, self.call_sync(held), signal=signal)
            return
        state.slots.acquire()
        try:
            if state.begin(held):
                state.finish(held, self.call_sync(held), signal=signal)
        finally:
            state.slots.release()

    def call_sync(self, held: Held) -> Outcome:
        """Call a sync ``perform`` (already begun); never raises."""
        if held.kept_result is not None:  # performed before; only its hook failed
            return Success(held.kept_result)
        started = time.monotonic()
        signal = signal_of(held.job)
        signal.started()  # its timeout, if any, runs from now
        try:
            if held.span is None:  # not traced: no context manager on the hot path
                result = held.effect.perform(prepare(held))
            else:
                with tracing.activated(held.span):
                    result = held.effect.perform(prepare(held))
            outcome: Outcome = (RETURNED_NONE if result is None
                                else Success(result_json(held.job, result)))
        except BaseException as exc:
            # Every failure is an outcome to record, even SystemExit raised by an effect:
            # the job must not vanish with its thread.
            outcome = exc
        self._measured(held, started)
        return outcome

    async def call_async(self, held: Held) -> Outcome:
        """Await an async ``perform`` (already begun); never raises."""
        if held.kept_result is not None:  # performed before; only its hook failed
            return Success(held.kept_result)
        started = time.monotonic()
        signal = signal_of(held.job)
        # Told to stop (job.cancelled), the task is cancelled while it awaits this perform.
        signal.started(asyncio.current_task())
        try:
            if held.span is None:
                result = await held.effect.perform(prepare(held))  # type: ignore[misc]
            else:
                with tracing.activated(held.span):
                    result = await held.effect.perform(prepare(held))  # type: ignore[misc]
            outcome: Outcome = (RETURNED_NONE if result is None
                                else Success(result_json(held.job, result)))
        except BaseException as exc:  # CancelledError included: settled as told (if told)
            outcome = exc
        signal.ended()
        self._measured(held, started)
        return outcome

    def _measured(self, held: Held, started: float) -> None:
        held.duration = elapsed = time.monotonic() - started
        # A moving average; a lost update between threads is harmless.
        mean = self.state.mean_perform_seconds
        self.state.mean_perform_seconds = elapsed if mean is None else 0.9 * mean + 0.1 * elapsed


class ThreadWorkers:
    """``Dispatcher``'s workers: threads for sync effects, a loop for async ones."""

    def __init__(self, settings: Settings, state: SharedState[Any],
                 start: Callable[[Callable[[], object], str], Started] = start_thread,
                 ) -> None:
        self.settings = settings
        self.state = state
        self.performer = Performer(state)
        self._start = start  # a thread of its own each, or a fleet's crew
        # With no async effects, the ``concurrency`` threads are the limit by themselves.
        self._gated = bool(settings.async_names)

    @contextmanager
    def running(self) -> Iterator[Callable[[list[Held]], None]]:
        """Yield a function that hands the workers a batch of claimed jobs; on exit, end
        them (after stop_timeout, within ``STUCK_GRACE``).

        Sync effects run on at most ``concurrency`` daemon threads fed by one
        C-implemented queue (no per-job futures), started only while units of work wait
        that no thread already started is idle to take (``DaemonPool``); async effects
        run as tasks on one event loop, started with the first async job.
        """
        state = self.state
        pool = DaemonPool(self.settings.concurrency, "outbox-worker", self._start,
                          supervise=lambda serve: supervised(state, "worker", serve))
        loop: list[LoopRunner] = []  # made when the first async job comes
        mixed = bool(self.settings.async_names)
        put, perform = pool.put, self._perform

        def submit(batch: list[Held]) -> None:
            sync = [h for h in batch if not h.is_async] if mixed else batch
            for chunk in self._chunks(sync):
                put(partial(perform, chunk))
            if len(sync) < len(batch):
                if not loop:
                    loop.append(LoopRunner(self.performer))
                loop[0].submit([h for h in batch if h.is_async])

        try:
            yield submit
        finally:
            pool.shutdown(wait=False)
            # After stop_timeout a perform that never returns keeps its (daemon) thread:
            # told to stop (job.cancelled), it gets a moment (STUCK_GRACE, for all of
            # them together), and the stop does not wait longer; its outcome is not
            # recorded.
            until = time.monotonic() + STUCK_GRACE if state.abandoned else None
            pool.join(until)
            for runner in loop:
                runner.close(None if until is None else max(0.01, until - time.monotonic()))

    def _perform(self, chunk: list[Held]) -> None:
        gated = self._gated
        for held in chunk:
            self.performer.perform_sync(held, signal=False, gated=gated)
        self.state.outcome_ready.set()  # once per chunk: the recorder takes them all

    def _chunks(self, batch: list[Held]) -> list[list[Held]]:
        """Split a claimed batch into the units workers take from the queue.

        Slow effects go one job per unit, so every worker stays busy. Effects measured to
        take under a millisecond go in runs spread over the workers: handing over each
        job separately would cost more in thread wake-ups than the jobs themselves.
        """
        mean = self.state.mean_perform_seconds
        concurrency = self.settings.concurrency
        if mean is None or mean >= FAST_EFFECT or len(batch) <= concurrency:
            return [[held] for held in batch]
        # Spread over the workers, but each run at least RUN_SECONDS of measured work
        # (at most MAX_RUN jobs): with the interpreter's lock, one thread performs as
        # fast as many, and each thread woken costs its hand-offs of the lock (a 2,000-job
        # batch of no-ops went to 63 threads; now to 8, and 2 did no better).
        size = max(-(-len(batch) // concurrency), int(RUN_SECONDS / max(mean, 1e-9)))
        size = min(MAX_RUN, size)
        return [batch[i:i + size] for i in range(0, len(batch), size)]


class LoopRunner:
    """``ThreadWorkers``' async half: an event loop on a thread of its own, running
    async effects as ``TaskWorkers`` (within the slots the threads take too)."""

    def __init__(self, performer: Performer) -> None:
        self._state = performer.state
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        target = supervised(self._state, "async worker loop", lambda: self._run(ready))
        self._thread = threading.Thread(target=target, name="outbox-async", daemon=True)
        self._thread.start()
        ready.wait()

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(self._ready, ready)
        self._loop.run_forever()

    def _ready(self, ready: threading.Event) -> None:
        self.workers = TaskWorkers(self._state, pool=None)  # made on the loop it runs on
        ready.set()

    def submit(self, batch: list[Held]) -> None:
        """Schedule a batch from any thread: one wake-up of the loop per batch."""
        self._loop.call_soon_threadsafe(self.workers.submit, batch)

    def close(self, grace: float | None = None) -> None:
        """Stop the loop once every task has finished; after stop_timeout (``grace``
        given) cancel what still runs, and wait at most ``grace`` for the loop."""

        async def finish() -> None:
            if self._state.abandoned:
                self.workers.cancel()
            await self.workers.join()
            # As asyncio.run does: what effects hold open for the loop's lifetime (their
            # connections) is closed on the loop, before it closes.
            await self._loop.shutdown_asyncgens()
            self._loop.stop()

        asyncio.run_coroutine_threadsafe(finish(), self._loop)
        self._thread.join(grace)
        if not self._thread.is_alive():
            self._loop.close()


class TaskWorkers:
    """Workers as tasks on the running event loop, each holding a slot: all of
    ``AsyncDispatcher``'s (a sync effect's ``perform`` goes to ``pool`` from the task
    that holds its slot), and ``Dispatcher``'s for async effects (on ``LoopRunner``).

    A task is made per job only while fewer tasks exist than jobs run at once: a task
    that finishes a job passes its slot on (``Slots.pass_on``) and, when the longest
    waiter is another job of ours, performs that job itself; when none is, it parks
    (holding no slot) until ``_start`` hands it the next job. So a steady stream of
    jobs costs no task per job, only the ``perform`` itself, whether the jobs queue for
    slots or arrive one claim at a time. ``join`` ends the parked tasks."""

    def __init__(self, state: SharedState[Any], pool: Executor | None) -> None:
        self.state = state
        self.performer = Performer(state)
        self.pool = pool
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._tasks: set[asyncio.Task[None]] = set()
        # Tasks waiting for a job, each on its future (a job, or None: end); touched on
        # the loop only. Bounded by the most jobs that ran at once (the concurrency).
        self._parked: deque[asyncio.Future[Held | None]] = deque()
        self._closing = False  # set by join: finished tasks end instead of parking

    def submit(self, batch: list[Held]) -> None:
        """Start ``batch``'s jobs as slots allow (on the loop)."""
        state = self.state
        for held in batch:
            if (state.releasing or held.lost) and not state.begin(held):
                continue  # handed back or dropped without waiting for a slot
            state.slots.when_free(_Start(self, held))

    def _start(self, held: Held) -> None:
        """Holding a slot: hand ``held`` to a parked task, else start a task for it.
        Under ``Dispatcher`` a sync effect's thread may be the one that freed the slot:
        the job is then started on the loop. (Under ``AsyncDispatcher`` slots are
        released on the loop only: sync effects' threads return their outcome to the
        loop first.)"""
        if threading.get_ident() != self._loop_thread:
            self._loop.call_soon_threadsafe(self._start, held)
            return
        while self._parked:
            parked = self._parked.pop()  # the latest parked: the warmest
            if not parked.done():  # not cancelled with its task
                parked.set_result(held)
                return
        task = self._loop.create_task(self._run(held))
        self._tasks.add(task)
        task.add_done_callback(self._done)

    async def _run(self, held: Held | None) -> None:
        """Holding a slot: perform ``held`` (or hand it back); then the next job of ours
        that the slot passes to, or, parked, the next job ``_start`` hands over. A
        cancelled perform ends the task. One coroutine for the whole stream: this is the
        hot path of async effects."""
        state, slots, performer = self.state, self.state.slots, self.performer
        while held is not None:
            try:
                if state.begin(held):
                    if held.is_async:
                        outcome = await performer.call_async(held)
                    else:  # on the pool; the outcome comes back to the loop
                        outcome = await self._loop.run_in_executor(
                            self.pool, performer.call_sync, held)
                    state.finish(held, outcome)
                    if isinstance(outcome, asyncio.CancelledError):
                        slots.release()
                        return
            except BaseException:
                slots.release()
                raise
            waiter = slots.pass_on()
            if type(waiter) is _Start and waiter.workers is self:
                held = waiter.held  # the slot stays with this task
                continue
            if waiter is not None:
                waiter()  # the slot goes to another kind of waiter
            if self._closing:
                return
            parked: asyncio.Future[Held | None] = self._loop.create_future()
            self._parked.append(parked)
            held = await parked  # holding no slot: _start took one for the job

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            self.state.fail("worker task", error)

    async def join(self) -> None:
        """Wait until every job handed over has finished (or been handed back); the
        tasks end as they finish (parked ones at once)."""
        self._closing = True
        while self._parked:
            parked = self._parked.pop()
            if not parked.done():
                parked.set_result(None)
        while self._tasks:
            await asyncio.wait(list(self._tasks))

    def cancel(self) -> list[asyncio.Task[None]]:
        """Cancel what still runs (an abandoned run: the rescuer takes those jobs)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        return tasks


class _Start:
    """A claimed job waiting for a slot: called by the slot's giver, it starts a task
    for the job; a task of the same workers passing its slot on runs the job itself."""

    __slots__ = ("held", "workers")

    def __init__(self, workers: TaskWorkers, held: Held) -> None:
        self.workers = workers
        self.held = held

    def __call__(self) -> None:
        self.workers._start(self.held)


def prepare(held: Held) -> Job:
    """The job as ``perform`` sees it: with ``model`` when the effect declares one.
    A payload Python could not read (``Undecodable``) fails the job, never performed."""
    payload = held.job.payload
    if type(payload) is Undecodable:
        raise Permanent(f"payload of job {held.job.id} cannot be read in Python "
                        f"({payload.reason})")
    model_type = getattr(held.effect, "payload_model", None)
    if model_type is None:
        return held.job
    try:
        model = model_type.model_validate(held.job.payload)
    except ValidationError as exc:
        raise Permanent(describe_validation(held.job.effect, exc)) from None
    return dataclasses.replace(held.job, model=model)


def result_json(job: Job, result: object) -> str:
    """What ``perform`` returned as JSON text the ledger can store."""
    if result is None:
        return "null"
    try:
        if isinstance(result, BaseModel):
            text = result.model_dump_json()
        else:
            text = json.dumps(result, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
        problem = jsonb_problem(text)
        if problem:
            raise ValueError(problem)
        return text
    except (TypeError, ValueError) as exc:
        # The effect has happened; refusing to record it would make it happen again.
        log.error("job %s (key %s): result is not JSON (%s); recorded without it",
                  job.id, job.key, type(exc).__name__)
        return json.dumps({"unrecorded_result": type(result).__name__})


def describe_validation(effect: str, error: ValidationError) -> str:
    """A validation error as one line naming the fields (never their values)."""
    problems = []
    for item in error.errors(include_input=False, include_url=False):
        where = ".".join(str(part) for part in item["loc"]) or "(payload)"
        problems.append(f"{where}: {item['msg']}")
    return f"payload invalid for effect {effect!r}: " + "; ".join(problems)


P = ParamSpec("P")
T = TypeVar("T")


class DaemonPool(Executor):
    """At most ``size`` daemon threads serving one queue of calls in order, started as
    calls come: a pool that is handed nothing starts nothing, one handed three slow
    calls at once starts three. ``Dispatcher``'s worker threads (``put``, a plain call
    per unit of work) and ``AsyncDispatcher``'s threads for sync effects (``submit``, an
    ``Executor``).

    A thread is started only while calls wait that no idle thread will take, one at a
    time: ``put`` starts one when none is being started; a thread that takes a call
    with more still waiting and none idle starts the next before it performs its call.
    So a burst of quick calls is served by the few threads that start while it lasts
    (each start costs more than such a call), a burst of slow ones grows the pool until
    every call has a thread or ``size`` are running, and a call that never returns never
    holds up the calls behind it while fewer than ``size`` threads are started.

    Unlike ``ThreadPoolExecutor``'s threads, which the interpreter joins at exit, a call
    that never returns does not keep the process alive once the run has returned after
    its stop timeout, and ``join`` can give up after a deadline. Threads come from
    ``start`` (a fleet's crew), else from the fleet's turn (``crew.turn_share``), else
    are threads of their own; ``supervise`` wraps each thread's loop (the dispatcher's
    supervision: a call that raises ends its thread, which is a death to report).

    ``put``/``submit`` and ``shutdown`` are called from one thread at a time (the
    claimer's; the event loop's)."""

    def __init__(self, size: int, name: str,
                 start: Callable[[Callable[[], object], str], Started] | None = None,
                 *, supervise: Callable[[Callable[[], None]], Callable[[], None]] | None = None,
                 ) -> None:
        if start is None:
            # In a fleet's turn, the fleet's long-lived threads (``crew.turn_share``).
            share = turn_share.get()
            start = start_thread if share is None else share.start
        self._size = size
        self._name = name
        self._start = start
        self._target = self._serve if supervise is None else supervise(self._serve)
        self._queue: SimpleQueue[Callable[[], object] | None] = SimpleQueue()
        # The counts below, and the list, are read and written under _lock.
        self._lock = threading.Lock()
        self._added = threading.Condition(self._lock)  # a thread handle added to the list
        self._threads: list[Started] = []
        self._counted = 0  # threads started or being started
        self._starting = False  # a thread is being started (not yet serving)
        self._spawning = 0  # threads being started whose handle is not in the list yet
        self._idle = 0  # threads serving and not in a call: waiting for one, or about to
        self._queued = 0  # calls put and not yet taken by a thread
        self._shut = False

    @property
    def threads_started(self) -> int:
        """How many threads this pool has started (at most ``size``)."""
        return self._counted

    @property
    def idle(self) -> int:
        """Threads started and not in a call (waiting for one)."""
        return self._idle

    def put(self, call: Callable[[], object]) -> None:
        """Queue ``call`` for a thread: an idle one, else one started for it (while
        fewer than ``size`` are and none is being started), else the first free."""
        with self._lock:
            if self._shut:
                raise RuntimeError("cannot put work into a pool that was shut down")
            self._queue.put(call)
            self._queued += 1
            number = self._growing()
        if number is not None:
            self._spawn(number)

    def _growing(self) -> int | None:
        """Under ``_lock``: the number of a thread to start now, if calls wait that no
        idle thread will take, none is being started and fewer than ``size`` are."""
        if self._starting or self._queued <= self._idle or self._counted >= self._size:
            return None
        self._starting = True
        self._spawning += 1
        self._counted += 1
        if self._shut:  # its end marker, after the calls queued and the others' markers
            self._queue.put(None)
        return self._counted - 1

    def _spawn(self, number: int) -> None:
        thread = None
        try:  # outside the lock: the threads that finish calls do not wait for a start
            thread = self._start(self._target, f"{self._name}-{number}")
        finally:
            with self._added:
                self._spawning -= 1
                if thread is None:  # it could not start: the calls wait for the others
                    self._counted -= 1
                    self._starting = False
                else:
                    self._threads.append(thread)
                self._added.notify_all()

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        """Run ``fn(*args, **kwargs)`` on one of the threads; its future."""
        call = _FutureCall(partial(fn, *args, **kwargs))
        self.put(call)
        return call.future

    def _serve(self) -> None:
        get, lock = self._queue.get, self._lock
        with lock:
            self._starting = False
            self._idle += 1
        while (call := get()) is not None:
            with lock:
                self._queued -= 1
                self._idle -= 1
                number = self._growing()
            if number is not None:  # more wait behind this call: a thread for them first
                self._spawn(number)
            call()
            with lock:
                self._idle += 1

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """End the threads once the calls queued are served (``cancel_futures``: those
        not started are dropped, their futures cancelled); ``wait``: join them. A thread
        started after this (for calls queued before it) gets its end marker as it
        starts."""
        with self._lock:
            self._shut = True
            if cancel_futures:
                while not self._queue.empty():
                    if isinstance(call := self._queue.get_nowait(), _FutureCall):
                        call.future.cancel()
                        self._queued -= 1
            for _ in range(self._counted):
                self._queue.put(None)
        if wait:
            self.join()

    def join(self, until: float | None = None) -> None:
        """Wait for the threads to end (after ``shutdown``), those started meanwhile
        too; with ``until`` (a ``time.monotonic()`` deadline), no longer than that,
        leaving the rest behind."""
        joined = 0
        while True:
            with self._added:
                while joined == len(self._threads) and self._spawning:
                    if not self._added.wait(None if until is None
                                            else max(0.0, until - time.monotonic())):
                        return  # past the deadline, a thread still starting
                if joined == len(self._threads):
                    return
                thread = self._threads[joined]
            joined += 1
            thread.join(None if until is None else max(0.0, until - time.monotonic()))


class _FutureCall:
    """A call whose outcome goes to ``future`` (``DaemonPool.submit``); never raises."""

    __slots__ = ("fn", "future")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.future: Future[Any] = Future()

    def __call__(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            result = self.fn()
        except BaseException as exc:
            self.future.set_exception(exc)
        else:
            self.future.set_result(result)
