"""One stop path that cannot be lost: ``stop()`` from another thread at any moment of a
dispatcher's start makes ``run()`` return.

Three ways of reaching every moment: a stop injected on entry to each step of the start
(the state made, the schema checked, the access checked, the parts started), the
interleaving that used to lose it (the stopping thread reads "no run yet", the run then
starts and checks for an early stop, only then does the stopping thread note it), forced
deterministically, and stops issued after increasing delays from the call to ``run()``.
A stop is one run's: before ``run()``, or from another thread during one, it ends that
run only, and the next run of the same dispatcher claims and performs again.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

import outbox
import outbox.dispatcher as dispatcher_module
from outbox import AsyncDispatcher, Dispatcher, DispatchStats, Effect, Job
from outbox.testing import jobs

from .helpers import wait_until

RETURNS_WITHIN = 60.0  # generous: a loaded machine; a lost stop never returns at all
DELAYS = (0.0, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3)


class Noop(Effect):
    name = "test.noop"

    def perform(self, job: Job) -> None:
        return None


class AsyncNoop(Effect):
    name = "test.async_noop"

    async def perform(self, job: Job) -> None:
        return None


def _stop_from_another_thread(dispatcher: Dispatcher | AsyncDispatcher, *,
                              wait: bool) -> threading.Thread:
    thread = threading.Thread(target=dispatcher.stop, name="stopper")
    thread.start()
    if wait:
        thread.join(RETURNS_WITHIN)
        assert not thread.is_alive(), "stop() blocked"
    return thread


def _run_async(dispatcher: AsyncDispatcher) -> DispatchStats:
    return asyncio.run(asyncio.wait_for(dispatcher.run(), RETURNS_WITHIN))


def _run_sync(dispatcher: Dispatcher) -> DispatchStats:
    """``run()`` on a thread of its own, joined with a deadline (a lost stop would hang
    the test run otherwise); stopped for good after the deadline, then failed."""
    result: list[DispatchStats | BaseException] = []

    def serve() -> None:
        try:
            result.append(dispatcher.run())
        except BaseException as exc:  # handed to the test thread below
            result.append(exc)

    thread = threading.Thread(target=serve, name="run")
    thread.start()
    thread.join(RETURNS_WITHIN)
    if thread.is_alive():
        dispatcher.stop()
        thread.join(RETURNS_WITHIN)
        pytest.fail("run() did not return after stop()")
    [outcome] = result
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


# -- a stop on entry to each step of the start ----------------------------------------------

ASYNC_STEPS = ("SharedState", "wait_for_schema_async", "check_access_async", "_dispatch")
SYNC_STEPS = ("wait_for_schema", "check_access", "_dispatch")


def _inject(monkeypatch: pytest.MonkeyPatch, dispatcher: Dispatcher | AsyncDispatcher,
            step: str) -> list[threading.Thread]:
    """Have ``stop()`` called from another thread as ``step`` begins (once)."""
    stoppers: list[threading.Thread] = []
    if step == "_dispatch":
        original: Callable[..., Any] = dispatcher._dispatch
    else:
        original = getattr(dispatcher_module, step)

    def stop_then(*args: Any, **kwargs: Any) -> Any:
        if not stoppers:
            # SharedState is made under the lock stop() takes: that stop() waits for
            # the lock, so it cannot be waited for here; it lands as the start goes on.
            stoppers.append(_stop_from_another_thread(dispatcher,
                                                      wait=step != "SharedState"))
        return original(*args, **kwargs)

    if step == "_dispatch":
        monkeypatch.setattr(dispatcher, "_dispatch", stop_then)
    else:
        monkeypatch.setattr(dispatcher_module, step, stop_then)
    return stoppers


@pytest.mark.parametrize("step", ASYNC_STEPS)
def test_async_stop_at_each_step_of_the_start_ends_run(
    dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch, step: str,
) -> None:
    dispatcher = AsyncDispatcher(dsn, [AsyncNoop()], schema=schema)
    stoppers = _inject(monkeypatch, dispatcher, step)
    stats = _run_async(dispatcher)
    assert len(stoppers) == 1, f"{step} was not reached: the injection tested nothing"
    stoppers[0].join(RETURNS_WITHIN)
    assert stats.claimed == 0
    assert not dispatcher._running and dispatcher._state is None


@pytest.mark.parametrize("step", SYNC_STEPS)
def test_sync_stop_at_each_step_of_the_start_ends_run(
    dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch, step: str,
) -> None:
    dispatcher = Dispatcher(dsn, [Noop()], schema=schema)
    stoppers = _inject(monkeypatch, dispatcher, step)
    stats = _run_sync(dispatcher)
    assert len(stoppers) == 1, f"{step} was not reached: the injection tested nothing"
    assert stats.claimed == 0
    assert not dispatcher._running


# -- the interleaving that lost the stop, forced -------------------------------------------


class SlowToNote:
    """A dispatcher whose ``stop()``, called from the thread named "stopper", pauses
    between reading whether a run is under way and acting on it until the run has got
    past its start (up to ``PAUSE`` seconds: with the lock, the run cannot get past while
    ``stop()`` holds it, and the pause runs out)."""

    PAUSE = 2.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.started = threading.Event()
        self.paused = threading.Event()
        super().__init__(*args, **kwargs)

    @property
    def _running(self) -> Any:
        running = self.__dict__.get("_running_value")
        if threading.current_thread().name == "stopper":
            self.paused.set()
            self.started.wait(self.PAUSE)
        return running

    @_running.setter
    def _running(self, value: Any) -> None:
        self.__dict__["_running_value"] = value


class SlowToNoteAsync(SlowToNote, AsyncDispatcher):
    pass


class SlowToNoteSync(SlowToNote, Dispatcher):
    pass


@pytest.fixture()
def started_hook(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[SlowToNote]]:
    """Sets the dispatcher's ``started`` once its run is past the check for an early
    stop (at the schema check, the first step after it)."""
    dispatchers: list[SlowToNote] = []
    blocking = getattr(dispatcher_module, "wait_for_schema")  # noqa: B009 - not exported
    in_asyncio = getattr(dispatcher_module, "wait_for_schema_async")  # noqa: B009

    def started(*args: Any, **kwargs: Any) -> None:
        for dispatcher in dispatchers:
            dispatcher.started.set()
        blocking(*args, **kwargs)

    async def started_async(*args: Any, **kwargs: Any) -> None:
        for dispatcher in dispatchers:
            dispatcher.started.set()
        await in_asyncio(*args, **kwargs)

    monkeypatch.setattr(dispatcher_module, "wait_for_schema", started)
    monkeypatch.setattr(dispatcher_module, "wait_for_schema_async", started_async)
    yield dispatchers


def test_a_stop_that_reads_no_run_yet_is_not_lost_when_the_run_starts(
    dsn: str, schema: str, started_hook: list[SlowToNote],
) -> None:
    dispatcher = SlowToNoteAsync(dsn, [AsyncNoop()], schema=schema)
    started_hook.append(dispatcher)

    async def scenario() -> DispatchStats:
        stopper = _stop_from_another_thread(dispatcher, wait=False)
        # stop() has read "no run yet" and holds on; only then does the run start.
        assert await asyncio.to_thread(dispatcher.paused.wait, RETURNS_WITHIN)
        stats = await asyncio.wait_for(dispatcher.run(), RETURNS_WITHIN)
        await asyncio.to_thread(stopper.join, RETURNS_WITHIN)
        return stats

    assert asyncio.run(scenario()).claimed == 0


def test_the_same_interleaving_does_not_lose_a_dispatchers_stop(
    dsn: str, schema: str, started_hook: list[SlowToNote],
) -> None:
    """One stop path for both: the blocking ``Dispatcher``'s stop is the same."""
    dispatcher = SlowToNoteSync(dsn, [Noop()], schema=schema)
    started_hook.append(dispatcher)
    stopper = _stop_from_another_thread(dispatcher, wait=False)
    assert dispatcher.paused.wait(RETURNS_WITHIN)
    assert _run_sync(dispatcher).claimed == 0
    stopper.join(RETURNS_WITHIN)


# -- stops after increasing delays -----------------------------------------------------------


def test_async_stop_after_any_delay_ends_run(dsn: str, schema: str) -> None:
    for delay in DELAYS:
        dispatcher = AsyncDispatcher(dsn, [AsyncNoop()], schema=schema, poll_interval=0.05)
        timer = threading.Timer(delay, dispatcher.stop)

        async def serve(d: AsyncDispatcher = dispatcher,
                        t: threading.Timer = timer) -> DispatchStats:
            t.start()  # the delay counts from the call to run()
            return await asyncio.wait_for(d.run(), RETURNS_WITHIN)

        asyncio.run(serve())
        timer.join(RETURNS_WITHIN)


def test_sync_stop_after_any_delay_ends_run(dsn: str, schema: str) -> None:
    for delay in DELAYS:
        dispatcher = Dispatcher(dsn, [Noop()], schema=schema, poll_interval=0.05)
        timer = threading.Timer(delay, dispatcher.stop)
        timer.start()
        _run_sync(dispatcher)
        timer.join(RETURNS_WITHIN)


# -- a stop is one run's: the next run starts afresh --------------------------------------------


def _enqueue(dsn: str, schema: str, effect: str, keys: list[str]) -> None:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue_many([outbox.NewJob(effect, key, {}) for key in keys])


def _statuses(dsn: str, schema: str, keys: list[str]) -> set[str]:
    with psycopg.connect(dsn) as conn:
        found = jobs(conn, schema)
    return {found[key]["status"] for key in keys}


def _run_on_a_thread(dispatcher: Dispatcher | AsyncDispatcher,
                     ) -> Callable[[], DispatchStats]:
    """``run()`` started on a thread of its own (its own loop for ``AsyncDispatcher``);
    what waits for it to return (bounded) and answers its counters."""
    if isinstance(dispatcher, Dispatcher):
        sync = dispatcher
        result: list[DispatchStats] = []
        thread = threading.Thread(target=lambda: result.append(_run_sync(sync)))
    else:
        in_asyncio = dispatcher
        result = []
        thread = threading.Thread(target=lambda: result.append(_run_async(in_asyncio)))
    thread.start()

    def returned() -> DispatchStats:
        thread.join(2 * RETURNS_WITHIN)
        assert not thread.is_alive() and result, "run() did not return after stop()"
        return result[0]

    return returned


def _until_idle(dispatcher: Dispatcher | AsyncDispatcher) -> DispatchStats:
    if isinstance(dispatcher, Dispatcher):
        return dispatcher.run_until_idle(timeout=RETURNS_WITHIN)
    return asyncio.run(dispatcher.run_until_idle(RETURNS_WITHIN))


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_stop_is_one_runs_and_the_next_run_starts_afresh(
    dsn: str, schema: str, flavour: str,
) -> None:
    """``stop()`` before ``run()``: that run returns having claimed nothing, and only that
    run: the next one performs what is due. ``stop()`` from another thread during a run:
    the run returns, and the next run of the same dispatcher claims and performs again
    (twice over: nothing of a stopped run is left to stop the one after it)."""
    dispatcher: Dispatcher | AsyncDispatcher = (
        Dispatcher(dsn, [Noop()], schema=schema, poll_interval=0.05) if flavour == "sync"
        else AsyncDispatcher(dsn, [AsyncNoop()], schema=schema, poll_interval=0.05))
    effect = "test.noop" if flavour == "sync" else "test.async_noop"
    early = ["early-1", "early-2", "early-3"]
    _enqueue(dsn, schema, effect, early)

    dispatcher.stop()  # before any run, from this thread; the run comes on another
    assert _run_on_a_thread(dispatcher)().claimed == 0
    assert _statuses(dsn, schema, early) == {"pending"}
    assert _until_idle(dispatcher).done == 3  # the stop was the last run's only

    for round_ in ("first", "second"):
        keys = [f"{round_}-{i}" for i in range(4)]
        _enqueue(dsn, schema, effect, keys)
        returned = _run_on_a_thread(dispatcher)

        def performed(keys: list[str] = keys) -> bool:
            return _statuses(dsn, schema, keys) == {"done"}

        wait_until(performed, timeout=RETURNS_WITHIN, what=f"the {round_} run's jobs done")
        _stop_from_another_thread(dispatcher, wait=True)
        stats = returned()
        assert (stats.claimed, stats.done) == (4, 4), round_
        assert not dispatcher._running
