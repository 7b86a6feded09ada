"""The parts of ``AsyncDispatcher``: the same claimer, recorder and performer logic as
``Dispatcher``'s, driven as tasks on one event loop over asyncio connections.

Only the loops differ from the threaded ones (waiting, sleeping, cancelling); every
decision is the shared steps' (``claimer``, ``recorder``) and ``Performer``'s. Sync
effects run on a bounded thread pool; async ones as tasks; both within the one limit,
``SharedState.slots``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable
from concurrent.futures import Executor

import psycopg

from .. import _state
from .._pg import is_pooled, unreachable
from .._steps import run_async
from ..errors import ConfigurationError
from ..migrate import require_current
from .claimer import Claimer
from .connection import CONNECTION_ERRORS, AsyncConnection, Reconnects, connect
from .hooks import close_quietly, flush_hooked_async
from .listener import POLLING, listen_statement
from .recorder import Recorder
from .settings import Settings
from .state import Held, Outcome, SharedState, Timer
from .workers import Performer

__all__ = [
    "LoopEvent",
    "TaskWorkers",
    "listen_async",
    "run_claimer_async",
    "run_recorder_async",
    "supervised_async",
    "wait_for_schema_async",
]

log = logging.getLogger("outbox.dispatcher")

AsyncState = SharedState["LoopEvent"]


class LoopEvent:
    """A ``threading.Event`` look-alike for one event loop: ``set`` from any thread (so
    ``stop()`` and sync effects' threads can signal), waited on by tasks."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()
        self._event = asyncio.Event()
        self._flag = False

    def set(self) -> None:
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


async def supervised_async(state: AsyncState, part: str, body: Awaitable[None]) -> None:
    """Await ``body``; its unexpected death stops the dispatcher loudly."""
    try:
        await body
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # reported, then the dispatcher stops
        state.fail(part, exc)


def _check_schema(settings: Settings) -> None:
    with connect(settings, "claimer") as conn:
        require_current(conn, settings.schema)


async def wait_for_schema_async(
    settings: Settings, state: AsyncState, deadline: float | None
) -> None:
    """Refuse a missing or newer schema at once; wait for an unreachable database
    (until ``deadline``, when there is one). The check runs on a thread: it is the
    same blocking check as ``Dispatcher``'s, once per run."""
    failures = Reconnects()
    while True:
        try:
            await asyncio.to_thread(_check_schema, settings)
            return
        except CONNECTION_ERRORS as exc:
            if deadline is not None and time.monotonic() >= deadline:
                raise
            log.warning("cannot reach the database at %s; retrying",
                        unreachable(exc, settings.conninfo))
            if await state.stopping.wait(failures.backoff()):
                return


async def run_claimer_async(
    claimer: Claimer, conn: AsyncConnection, workers: TaskWorkers, deadline: float | None,
) -> None:
    """The claimer's loop as a task, until stopped, idle or ``deadline``."""
    state: AsyncState = claimer.state
    try:
        while not state.stopping.is_set():
            if deadline is not None and time.monotonic() >= deadline:
                return
            # A task of its own, shielded: a cancellation must not cut a claim off between
            # its commit and its reply, leaving claimed jobs that nobody holds.
            step = asyncio.ensure_future(run_async(claimer.round(), conn.execute))
            try:
                result = await asyncio.shield(step)
            except asyncio.CancelledError:
                state.request_stop()  # nothing new starts: what this round claims goes back
                with contextlib.suppress(psycopg.Error):
                    workers.submit((await step).batch)
                raise
            except psycopg.Error as exc:
                claimer.failed(exc, lost=conn.lost)
                wait = conn.backoff()
            else:
                workers.submit(result.batch)
                if result.idle:
                    return
                wait = result.wait
            if wait:
                await state.wake.wait(wait)
                state.wake.clear()
    finally:
        if not conn.lost:  # stopping: say so at once, if the database is there
            with contextlib.suppress(psycopg.Error):
                await run_async(claimer.presence.leave(), conn.execute)


async def run_recorder_async(recorder: Recorder, conn: AsyncConnection) -> None:
    """The recorder's loop as a task, until ``Recorder.finished``."""
    state: AsyncState = recorder.state
    heartbeat = Timer(_state.heartbeat_interval(recorder.settings.lease))
    heartbeat.next_at = time.monotonic() + heartbeat.interval
    pending: list[tuple[Held, Outcome]] = []
    try:
        while not recorder.finished(pending):
            await state.outcome_ready.wait(min(heartbeat.interval, 0.5))
            state.outcome_ready.clear()
            pending.extend(state.take_outcomes())
            try:
                if pending:
                    await run_async(recorder.flush(pending), conn.execute)
                if recorder.hooked_waiting:
                    await flush_hooked_async(recorder.hooks, conn)  # type: ignore[arg-type]
                recorder.retrying = False
                if heartbeat.due(time.monotonic()):
                    await run_async(recorder.heartbeat(), conn.execute)
            except CONNECTION_ERRORS as exc:
                recorder.failed(exc, lost=conn.lost, pending=pending)
                await asyncio.sleep(conn.backoff())
            except ConfigurationError:
                raise  # a missing privilege: no retry will help
            except psycopg.Error as exc:  # a heartbeat statement failed: next round
                log.error("heartbeat failed: %s",
                          getattr(exc, "sqlstate", None) or type(exc).__name__)
                await asyncio.sleep(conn.backoff())
            # Anything else is a bug: it ends the recorder (supervised_async), and the
            # run raises DispatcherFailed.
    finally:
        close_quietly(recorder.hooks)
        await conn.discard()


async def listen_async(settings: Settings, state: AsyncState) -> None:
    """Turn enqueue notifications into wake-ups until cancelled; restart after any
    ``Exception`` (the claimer polls too: a notification is only a hint)."""
    conn = AsyncConnection(settings, "listener")
    try:
        while True:
            try:
                listening = await conn.get()
                if is_pooled(listening):
                    log.info(POLLING)
                    return
                await listening.execute(listen_statement(settings))
                state.wake.set()  # jobs may have arrived while we were not listening
                async for _ in listening.notifies():
                    state.wake.set()
            except CONNECTION_ERRORS:
                await conn.discard()
                await asyncio.sleep(conn.backoff())
            except ConfigurationError as exc:
                log.error("cannot LISTEN (%s); polling instead", exc)
                return
            except Exception:
                log.exception("listener failed unexpectedly; restarting it")
                await conn.discard()
                await asyncio.sleep(conn.backoff())
    finally:
        await conn.discard()


class TaskWorkers:
    """``AsyncDispatcher``'s workers: tasks on the loop, each holding a slot; a sync
    effect's ``perform`` goes to ``pool`` from the task that holds its slot.

    A task that finishes a job passes its slot on (``Slots.pass_on``); when the longest
    waiter is another job of ours it performs that job itself, so a steady stream of
    jobs costs no task per job, only the ``perform`` itself."""

    def __init__(self, state: AsyncState, pool: Executor | None) -> None:
        self.state = state
        self.performer = Performer(state)
        self.pool = pool
        self._loop = asyncio.get_running_loop()
        self._tasks: set[asyncio.Task[None]] = set()

    def submit(self, batch: list[Held]) -> None:
        state = self.state
        for held in batch:
            if (state.releasing or held.lost) and not state.begin(held):
                continue  # handed back or dropped without waiting for a slot
            # Slots are released on the loop only (sync effects' threads return their
            # outcome to the loop first), so a start always runs on the loop.
            state.slots.when_free(_Start(self, held))

    def _start(self, held: Held) -> None:
        task = self._loop.create_task(self._run(held))
        self._tasks.add(task)
        task.add_done_callback(self._done)

    async def _run(self, held: Held) -> None:
        """Holding a slot: perform ``held`` (or hand it back); then, while the slot passes
        to another job of ours, perform that one too. A cancelled perform ends the task.
        One coroutine for the whole stream: this is the hot path of async effects."""
        state, slots, performer = self.state, self.state.slots, self.performer
        while True:
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
            if type(waiter) is not _Start or waiter.workers is not self:
                if waiter is not None:
                    waiter()
                return
            held = waiter.held

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            self.state.fail("worker task", error)

    async def join(self) -> None:
        """Wait until every job handed over has finished (or been handed back)."""
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
