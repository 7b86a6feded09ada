"""``AsyncDispatcher``'s fleet shares as ``Dispatcher``'s does: over many turns its
connections come from an async pool bounded by the budget, its sync effects run on the
fleet's long-lived threads, and a target's schema is checked at its first turn only
(counted, never timed). And a fleet's run starts once: of two run() calls racing, one
runs and the other gets a clear error, and its options are not changed under it. (The
async pool alone: ``test_crew``.)"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from outbox import AsyncDispatcher, ConfigurationError, Dispatcher, Target

from .support import Databases, Recorded, Started
from .test_fleet_turn_cost import BUDGET, CONCURRENCY, TARGETS, serve_rounds, wait_for


class Opened:
    """``Started``'s counts (threads, blocking connections) and the dispatcher's
    asyncio connections opened, by name."""

    def __init__(self, started: Started) -> None:
        self.started = started
        self.async_connections = 0

    @property
    def threads(self) -> int:
        return self.started.threads

    @property
    def connections(self) -> int:
        return self.started.connections


@pytest.fixture
def opened(started: Started, monkeypatch: pytest.MonkeyPatch) -> Iterator[Opened]:
    counts = Opened(started)
    connect_async = psycopg.AsyncConnection.connect

    async def counted_connect_async(*args: Any, **kwargs: Any) -> Any:
        if str(kwargs.get("application_name", "")).startswith("outbox"):
            with started.lock:
                counts.async_connections += 1
        return await connect_async(*args, **kwargs)

    monkeypatch.setattr(psycopg.AsyncConnection, "connect", counted_connect_async)
    yield counts


def async_fleet(databases: Databases, prefix: str,
                ) -> tuple[AsyncDispatcher, list[Target], Recorded]:
    names = [f"{prefix}{n}" for n in range(TARGETS)]
    shared = databases.make(*names)
    targets = [Target(shared, name) for name in names]
    effect = Recorded()  # a sync effect: performed on threads
    dispatcher = AsyncDispatcher(effects=[effect], targets=targets, concurrency=CONCURRENCY,
                                 max_connections=BUDGET, poll_interval=0.2)
    return dispatcher, targets, effect


class OnItsLoop:
    """``AsyncDispatcher.run()`` on a loop of its own, run and stopped as a thread's."""

    def __init__(self, dispatcher: AsyncDispatcher) -> None:
        self.dispatcher = dispatcher

    def run(self) -> object:
        return asyncio.run(self.dispatcher.run())

    def stop(self) -> None:
        self.dispatcher.stop()


def test_async_turns_share_connections_and_threads_within_a_bound(
        databases: Databases, opened: Opened) -> None:
    dispatcher, targets, effect = async_fleet(databases, "a")
    turns = serve_rounds(OnItsLoop(dispatcher), targets, effect)
    # Each turn its own: a schema check, a claimer and a recorder connection, and a
    # thread for the sync effect, every turn with a job (see the next test). Shared:
    # the asyncio connections at most the budget, the blocking ones one schema check
    # per target (its first turn), the threads at most the turns running at once times
    # CONCURRENCY, plus the look-out and the wake-up forwarder.
    assert opened.async_connections <= BUDGET, opened.async_connections
    assert opened.connections <= TARGETS + 1, opened.connections  # + the look-out's
    slots = BUDGET // 2
    assert opened.threads <= slots * CONCURRENCY + 2, opened.threads
    assert opened.threads < turns


def test_async_turns_without_sharing_pay_each_turn(
        databases: Databases, opened: Opened) -> None:
    # The same rounds with each turn its own (``Fleet.shared = False``): the counts
    # follow the turns, past the bounds above; what the test above bounds is the sharing.
    dispatcher, targets, effect = async_fleet(databases, "b")
    assert dispatcher._fleet is not None
    dispatcher._fleet.shared = False
    turns = serve_rounds(OnItsLoop(dispatcher), targets, effect)
    assert opened.async_connections >= 2 * turns, opened.async_connections
    assert opened.connections >= turns, opened.connections  # a schema check each
    assert opened.threads >= turns, opened.threads


def _run_twice_at_once(run: Any, stop: Any) -> tuple[list[object], list[BaseException]]:
    """``run`` called by two threads released together: what each returned or raised.
    The loser raises at once; the winner runs until ``stop``."""
    barrier = threading.Barrier(2)
    returned: list[object] = []
    raised: list[BaseException] = []
    lock = threading.Lock()

    def call() -> None:
        barrier.wait(30)
        try:
            value = run()
        except BaseException as exc:  # collected for the assertions
            with lock:
                raised.append(exc)
            return
        with lock:
            returned.append(value)

    threads = [threading.Thread(target=call, name=f"test-run-{n}") for n in range(2)]
    for thread in threads:
        thread.start()
    try:
        wait_for(lambda: len(raised) + len(returned) >= 1, "one run() to be refused")
    finally:
        stop()
        for thread in threads:
            thread.join(60)
    assert not any(thread.is_alive() for thread in threads)
    return returned, raised


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_two_runs_at_once_one_runs_and_one_is_refused(databases: Databases,
                                                      flavour: str) -> None:
    shared = databases.make("r0", "r1")
    targets = [Target(shared, "r0"), Target(shared, "r1")]
    for round_ in range(3):  # each round a fresh race
        effect = Recorded()
        if flavour == "sync":
            sync = Dispatcher(effects=[effect], targets=targets, poll_interval=0.2)
            returned, raised = _run_twice_at_once(sync.run, sync.stop)
        else:
            aio = AsyncDispatcher(effects=[effect], targets=targets, poll_interval=0.2)
            returned, raised = _run_twice_at_once(lambda: asyncio.run(aio.run()), aio.stop)  # noqa: B023
        assert len(returned) == 1 and len(raised) == 1, (round_, returned, raised)
        assert isinstance(raised[0], ConfigurationError), raised[0]
        assert "already running" in str(raised[0])


def test_a_fleet_refuses_changes_to_its_options_while_it_runs(databases: Databases) -> None:
    shared = databases.make("o0")
    effect = Recorded()
    dispatcher = Dispatcher(effects=[effect], targets=[Target(shared, "o0")],
                            poll_interval=0.2)
    assert dispatcher._fleet is not None
    fleet = dispatcher._fleet
    runner = threading.Thread(target=dispatcher.run, name="test-runner")
    runner.start()
    try:
        wait_for(lambda: fleet.running, "the run to start")
        with pytest.raises(ConfigurationError, match="before the dispatcher runs"):
            dispatcher.add_limits({})
    finally:
        dispatcher.stop()
        runner.join(60)
    assert not runner.is_alive() and not fleet.running
    dispatcher.add_limits({})  # after the run: allowed again
