"""A run written once (``outbox._dispatch.serving``): both dispatchers start and end their
parts in the same order, and a part's death surfaces the same way in both.

The order is observed where the run's program hands each part to its flavour (threads for
``Dispatcher``, tasks for ``AsyncDispatcher``): every ``start``, ``join`` and ``end`` the
program asks for, recorded by a flavour that records, then does what the real one does.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

import outbox
import outbox.dispatcher as dispatcher_module
from outbox import AsyncDispatcher, Dispatcher, DispatcherFailed, DispatchStats, Effect, Job
from outbox._dispatch import serving as serving_module
from outbox._dispatch.runtime import Program

RETURNS_WITHIN = 60.0  # generous: a loaded machine


class Noop(Effect):
    """Performs nothing; answers the reconciler that it never acted."""

    name = "test.noop"

    def perform(self, job: Job) -> None:
        return None

    def reconcile(self, job: Job) -> outbox.NotPerformed:
        return outbox.NotPerformed()


class AsyncNoop(Effect):
    name = "test.noop"

    async def perform(self, job: Job) -> None:
        return None

    async def reconcile(self, job: Job) -> outbox.NotPerformed:
        return outbox.NotPerformed()


def enqueue(dsn: str, schema: str, prefix: str, count: int) -> None:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue_many([outbox.NewJob("test.noop", f"{prefix}{i}", {})
                         for i in range(count)])


# -- what the program asks of each flavour, recorded ------------------------------------------


class Seen:
    """The flavour's calls of one run, as (what, part)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.parts: dict[int, str] = {}
        self.claiming = threading.Event()
        self.before: Callable[[tuple[str, str]], None] = lambda call: None

    def starting(self, part: str) -> None:
        self.before(("start", part))

    def started(self, part: str, handle: Any) -> Any:
        self.parts[id(handle)] = part
        self.calls.append(("start", part))
        return handle

    def saw(self, what: str, handle: Any = None) -> None:
        call = (what, "" if handle is None else self.parts[id(handle)])
        self.before(call)
        self.calls.append(call)


@pytest.fixture()
def seen(monkeypatch: pytest.MonkeyPatch) -> Iterator[Seen]:
    """Both flavours, recording every call the run's program makes of them."""
    record = Seen()

    class Threads(dispatcher_module._Threads):
        def prepare(self, *args: Any) -> None:
            record.saw("prepare")
            super().prepare(*args)

        def start(self, part: str, program: Program[None]) -> Any:
            record.starting(part)
            return record.started(part, super().start(part, program))

        def join(self, handle: Any, grace: float | None) -> None:
            record.saw("join", handle)
            super().join(handle, grace)

        def end(self, handle: Any, grace: float) -> None:
            record.saw("end", handle)
            super().end(handle, grace)

        def workers(self) -> Any:
            record.starting("workers")
            return record.started("workers", super().workers())

        def gate(self, submit: Any) -> Any:
            record.saw("claim")
            record.claiming.set()
            return super().gate(submit)

        def join_workers(self) -> None:
            record.calls.append(("join", "workers"))
            super().join_workers()

        def returned(self) -> None:
            record.saw("returned")
            super().returned()

    class Tasks(dispatcher_module._Tasks):
        async def prepare(self, *args: Any) -> None:
            record.saw("prepare")
            await super().prepare(*args)

        async def start(self, part: str, program: Program[None]) -> Any:
            record.starting(part)
            return record.started(part, await super().start(part, program))

        async def join(self, handle: Any, grace: float | None) -> None:
            record.saw("join", handle)
            await super().join(handle, grace)

        async def end(self, handle: Any, grace: float) -> None:
            record.saw("end", handle)
            await super().end(handle, grace)

        def workers(self) -> Any:
            record.starting("workers")
            return record.started("workers", super().workers())

        def gate(self, submit: Any) -> Any:
            record.saw("claim")
            record.claiming.set()
            return super().gate(submit)

        async def join_workers(self) -> None:
            record.calls.append(("join", "workers"))
            await super().join_workers()

        async def returned(self) -> None:
            record.saw("returned")
            await super().returned()

    monkeypatch.setattr(dispatcher_module, "_Threads", Threads)
    monkeypatch.setattr(dispatcher_module, "_Tasks", Tasks)
    yield record


def _run_sync(dispatcher: Dispatcher, *, until_idle: bool, seen: Seen) -> DispatchStats:
    """``run_until_idle``, or ``run`` on a thread stopped once it claims."""
    if until_idle:
        return dispatcher.run_until_idle(timeout=RETURNS_WITHIN)
    result: list[DispatchStats] = []
    thread = threading.Thread(target=lambda: result.append(dispatcher.run()))
    thread.start()
    assert seen.claiming.wait(RETURNS_WITHIN)
    dispatcher.stop()
    thread.join(RETURNS_WITHIN)
    assert not thread.is_alive(), "run() did not return after stop()"
    return result[0]


def _run_async(dispatcher: AsyncDispatcher, *, until_idle: bool, seen: Seen,
               stop: Callable[[asyncio.Task[DispatchStats]], object] | None = None,
               ) -> DispatchStats:
    """``run_until_idle``, or ``run`` stopped (``stop``: cancelled) once it claims."""
    async def main() -> DispatchStats:
        if until_idle:
            return await asyncio.wait_for(dispatcher.run_until_idle(RETURNS_WITHIN),
                                          RETURNS_WITHIN)
        task = asyncio.create_task(dispatcher.run())
        assert await asyncio.to_thread(seen.claiming.wait, RETURNS_WITHIN)
        if stop is None:
            dispatcher.stop()
        else:
            stop(task)
        done, _ = await asyncio.wait({task}, timeout=RETURNS_WITHIN)
        assert done, "run() did not return after the stop"
        return task.result()

    return asyncio.run(main())


IN_ORDER = {
    # run(): every part of its own, the reconciler's and the scheduler's first; ended
    # after the recorder, in the order they started.
    False: [("prepare", ""), ("start", "reconciler"), ("start", "scheduler"),
            ("start", "recorder"), ("start", "cancellation watcher"), ("start", "listener"),
            ("start", "workers"), ("claim", ""), ("join", "workers"), ("join", "recorder"),
            ("end", "reconciler"), ("end", "scheduler"), ("end", "cancellation watcher"),
            ("end", "listener"), ("returned", "")],
    # run_until_idle(): the reconciler's and the scheduler's one pass before any part
    # runs; no listener.
    True: [("prepare", ""), ("start", "recorder"), ("start", "cancellation watcher"),
           ("start", "workers"), ("claim", ""), ("join", "workers"), ("join", "recorder"),
           ("end", "cancellation watcher"), ("returned", "")],
}


@pytest.mark.parametrize("until_idle", [False, True], ids=["run", "run_until_idle"])
def test_both_dispatchers_start_and_end_their_parts_in_one_order(
    dsn: str, schema: str, seen: Seen, until_idle: bool,
) -> None:
    enqueue(dsn, schema, "a", 20)
    stats = _run_sync(Dispatcher(dsn, [Noop()], schema=schema, poll_interval=0.05),
                      until_idle=until_idle, seen=seen)
    in_threads, seen.calls, seen.claiming = seen.calls, [], threading.Event()
    enqueue(dsn, schema, "b", 20)
    async_stats = _run_async(AsyncDispatcher(dsn, [AsyncNoop()], schema=schema,
                                             poll_interval=0.05),
                             until_idle=until_idle, seen=seen)
    assert in_threads == seen.calls == IN_ORDER[until_idle]
    if until_idle:  # each run did the work it found (run() may be stopped before)
        assert (stats.done, async_stats.done) == (20, 20)


def test_a_first_cancellation_ends_the_parts_as_a_stop_does(
    dsn: str, schema: str, seen: Seen,
) -> None:
    _run_async(AsyncDispatcher(dsn, [AsyncNoop()], schema=schema, poll_interval=0.05),
               until_idle=False, seen=seen)  # stop(): the baseline
    stopped, seen.calls, seen.claiming = seen.calls, [], threading.Event()
    with pytest.raises(asyncio.CancelledError):
        _run_async(AsyncDispatcher(dsn, [AsyncNoop()], schema=schema, poll_interval=0.05),
                   until_idle=False, seen=seen, stop=lambda task: task.cancel())
    assert seen.calls == stopped == IN_ORDER[False]


def test_a_second_cancellation_abandons_the_wind_down(
    dsn: str, schema: str, seen: Seen,
) -> None:
    """Cancelled twice before the claimer leaves its loop: no drain, no join; every part
    ended (cancelled), the stop watch still told the run returned."""

    def twice(task: asyncio.Task[DispatchStats]) -> None:
        task.cancel()
        task.cancel()

    with pytest.raises(asyncio.CancelledError):
        _run_async(AsyncDispatcher(dsn, [AsyncNoop()], schema=schema, poll_interval=0.05),
                   until_idle=False, seen=seen, stop=twice)
    assert seen.calls == [
        ("prepare", ""), ("start", "reconciler"), ("start", "scheduler"),
        ("start", "recorder"), ("start", "cancellation watcher"), ("start", "listener"),
        ("start", "workers"), ("claim", ""), ("end", "recorder"), ("end", "reconciler"),
        ("end", "scheduler"), ("end", "cancellation watcher"), ("end", "listener"),
        ("returned", "")]


def _until_it_returns(dispatcher: Dispatcher | AsyncDispatcher,
                      until_idle: bool) -> DispatchStats:
    """The run, not stopped: a part's death must end it."""
    if isinstance(dispatcher, AsyncDispatcher):
        run = dispatcher.run_until_idle(RETURNS_WITHIN) if until_idle else dispatcher.run()
        return asyncio.run(asyncio.wait_for(run, RETURNS_WITHIN))
    if until_idle:
        return dispatcher.run_until_idle(timeout=RETURNS_WITHIN)
    result: list[DispatchStats | BaseException] = []

    def serve() -> None:
        try:
            result.append(dispatcher.run())
        except BaseException as exc:  # handed to the test's thread below
            result.append(exc)

    thread = threading.Thread(target=serve)
    thread.start()
    thread.join(RETURNS_WITHIN)
    if thread.is_alive():
        dispatcher.stop()
        thread.join(RETURNS_WITHIN)
        pytest.fail("run() went on after a part died")
    [outcome] = result
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


# -- a stop from another thread as each part starts ---------------------------------------------

STARTS = IN_ORDER[False][:IN_ORDER[False].index(("claim", "")) + 1]


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_stop_from_another_thread_as_any_part_starts_ends_run(
    dsn: str, schema: str, seen: Seen, flavour: str,
) -> None:
    """At the entry of each step of the start the run's program takes (the schema, each
    part, the workers, the claimer), ``stop()`` from another thread, waited for: ``run()``
    returns, having ended every part it started, in the order it always does."""
    enqueue(dsn, schema, "k", 5)
    for point in STARTS:
        seen.calls, seen.claiming = [], threading.Event()
        seen.claiming.set()  # nothing to wait for: the stop comes from the hook
        stoppers: list[threading.Thread] = []
        dispatcher: Dispatcher | AsyncDispatcher = (
            Dispatcher(dsn, [Noop()], schema=schema, poll_interval=0.05)
            if flavour == "sync" else
            AsyncDispatcher(dsn, [AsyncNoop()], schema=schema, poll_interval=0.05))

        def stop_at(call: tuple[str, str], point: tuple[str, str] = point,
                    dispatcher: Dispatcher | AsyncDispatcher = dispatcher,
                    stoppers: list[threading.Thread] = stoppers) -> None:
            if call == point and not stoppers:
                stopper = threading.Thread(target=dispatcher.stop, name="stopper")
                stoppers.append(stopper)
                stopper.start()
                stopper.join(RETURNS_WITHIN)
                assert not stopper.is_alive(), "stop() blocked"

        seen.before = stop_at
        _until_it_returns(dispatcher, until_idle=False)
        assert stoppers, f"{point} was not reached: the stop tested nothing"
        started = [call for call in seen.calls if call[0] == "start"]
        ended = [call for call in seen.calls if call[0] in ("join", "end")]
        assert {part for _, part in ended} == {part for _, part in started}, point
        assert not dispatcher._running


# -- a part's death, surfaced the same way by both ----------------------------------------------


class Fatal(BaseException):
    """Not an Exception: nothing on the way may swallow it as an ordinary error."""


def _dies(part: str) -> Callable[..., Program[None]]:
    def program(*args: Any, **kwargs: Any) -> Program[None]:
        raise Fatal(f"{part} died")
        yield  # a program: the raise comes from its first step, in the part's driver

    return program


PROGRAMS = {"reconciler": "reconciling", "scheduler": "scheduling", "recorder": "recording",
            "cancellation watcher": "watching", "listener": "listening"}
DEATHS = [(part, until_idle) for part in PROGRAMS for until_idle in (False, True)
          if not (part == "listener" and until_idle)]


@pytest.mark.parametrize(("part", "until_idle"), DEATHS,
                         ids=[f"{p.replace(' ', '-')}-{'idle' if u else 'run'}"
                              for p, u in DEATHS])
def test_a_parts_death_surfaces_the_same_way_in_both_dispatchers(
    dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    part: str, until_idle: bool,
) -> None:
    monkeypatch.setattr(serving_module, PROGRAMS[part], _dies(part))
    enqueue(dsn, schema, "k", 5)
    surfaced = []
    for dispatcher in (Dispatcher(dsn, [Noop()], schema=schema),
                       AsyncDispatcher(dsn, [AsyncNoop()], schema=schema)):
        caplog.clear()
        with pytest.raises(DispatcherFailed) as raised:
            _until_it_returns(dispatcher, until_idle)
        cause = raised.value.__cause__
        assert isinstance(cause, Fatal) and str(cause) == f"{part} died"
        died = [r.getMessage() for r in caplog.records if r.levelno == logging.CRITICAL]
        surfaced.append((str(raised.value), died, dispatcher._running))
    sync, in_asyncio = surfaced
    assert sync == in_asyncio
    message, died, running = sync
    assert died == [f"dispatcher {part} died of an unexpected error; stopping the dispatcher"]
    assert "died of Fatal" in message and not running


def test_a_run_after_a_failed_one_starts_afresh(dsn: str, schema: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The failure is the run's: the next run of the same dispatcher works."""
    enqueue(dsn, schema, "k", 5)
    sync = Dispatcher(dsn, [Noop()], schema=schema)
    in_asyncio = AsyncDispatcher(dsn, [AsyncNoop()], schema=schema)
    with monkeypatch.context() as patched:
        patched.setattr(serving_module, "watching", _dies("cancellation watcher"))
        with pytest.raises(DispatcherFailed):
            sync.run_until_idle(timeout=RETURNS_WITHIN)
        with pytest.raises(DispatcherFailed):
            asyncio.run(in_asyncio.run_until_idle(RETURNS_WITHIN))
    assert sync.run_until_idle(timeout=RETURNS_WITHIN).done == 5
    enqueue(dsn, schema, "b", 3)
    assert asyncio.run(in_asyncio.run_until_idle(RETURNS_WITHIN)).done == 3
