"""A fleet's turns share long-lived threads and connections: over many turns, the
threads it starts and the connections it opens stay within a bound set by its budget,
not by the number of turns (counted, never timed)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Protocol

import psycopg

from outbox import Dispatcher, Target

from .support import Databases, Recorded, Started, enqueue

TARGETS = 8
ROUNDS = 4
CONCURRENCY = 4
BUDGET = 8  # max_connections


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


class Runs(Protocol):
    """A dispatcher run on a thread: ``Dispatcher``, or an ``AsyncDispatcher`` on a loop."""

    def run(self) -> object: ...

    def stop(self) -> None: ...


def serve_rounds(dispatcher: Runs, targets: list[Target], effect: Recorded) -> int:
    """Run ``dispatcher`` while ROUNDS times every target gets one job, each round
    performed before the next is enqueued: at least ROUNDS x TARGETS turns."""
    runner = threading.Thread(target=dispatcher.run, name="test-runner")
    runner.start()
    try:
        for n in range(ROUNDS):
            for target in targets:
                enqueue(target, 1, first=n)
            expected = (n + 1) * len(targets)
            wait_for(lambda: len(effect.performed) == expected,  # noqa: B023 - waited here
                     f"round {n + 1}'s jobs")
    finally:
        dispatcher.stop()
        runner.join(60)
    assert not runner.is_alive()
    assert max(effect.performed.values()) == 1
    return ROUNDS * len(targets)


def fleet(databases: Databases, prefix: str, count: int = TARGETS,
          ) -> tuple[Dispatcher, list[Target], Recorded]:
    """A fleet dispatcher over ``count`` new schemas of one new database."""
    names = [f"{prefix}{n}" for n in range(count)]
    shared = databases.make(*names)
    targets = [Target(shared, name) for name in names]
    effect = Recorded()
    dispatcher = Dispatcher(effects=[effect], targets=targets, concurrency=CONCURRENCY,
                            max_connections=BUDGET, poll_interval=0.2)
    return dispatcher, targets, effect


def test_many_turns_start_threads_and_open_connections_within_a_bound(
        databases: Databases, started: Started) -> None:
    dispatcher, targets, effect = fleet(databases, "c")
    turns = serve_rounds(dispatcher, targets, effect)
    # A turn alone starts a recorder, a cancellation watcher and a stop watch (and the
    # turn's thread), and a worker for its job (workers start as jobs come, at most
    # CONCURRENCY), and opens a claimer and a recorder connection: made fresh each turn,
    # at least turns x 4 threads and turns x 2 connections. Shared, the threads are at
    # most the parts of the turns that run at once (slots of 2 connections in the
    # budget, CONCURRENCY + 4 parts each) plus the look-out and its wake-up; the
    # connections at most the budget.
    slots = BUDGET // 2
    assert started.threads <= slots * (CONCURRENCY + 4) + 2, started.threads
    assert started.threads < turns * 4
    assert started.connections <= BUDGET, started.connections
    assert Counter(effect.performed.values()) == Counter({1: turns})


def test_without_sharing_each_turn_pays_for_its_threads_and_connections(
        databases: Databases, started: Started) -> None:
    # The same rounds with each turn making its own parts (the fleet's former way, kept
    # for the benchmark): the counts then follow the turns, past the bound above.
    dispatcher, targets, effect = fleet(databases, "u")
    assert dispatcher._fleet is not None
    dispatcher._fleet.shared = False
    turns = serve_rounds(dispatcher, targets, effect)
    # Each turn performs one job (the rounds come one after another): its parts and a
    # worker for the job.
    assert started.threads >= turns * 4, started.threads
    assert started.connections >= turns * 2, started.connections


def test_kept_connections_cut_between_turns_are_replaced(databases: Databases) -> None:
    # The connections kept for the next turns are terminated by the server while idle:
    # the next turns find them broken, open new ones, and every job is performed once.
    dispatcher, targets, effect = fleet(databases, "k", count=3)
    shared = targets[0].dsn
    runner = threading.Thread(target=dispatcher.run, name="test-runner")
    runner.start()
    try:
        for target in targets:
            enqueue(target, 2)
        wait_for(lambda: len(effect.performed) == 6, "the first jobs")
        with psycopg.connect(shared, autocommit=True) as admin:
            def kept() -> int:
                row = admin.execute(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND state = 'idle' AND "
                    "(application_name LIKE 'outbox claimer %%' "
                    "OR application_name LIKE 'outbox recorder %%')").fetchone()
                return row[0] if row else 0

            wait_for(lambda: kept() > 0, "a kept connection to cut")
        for target in targets:
            enqueue(target, 2, first=2)
        wait_for(lambda: len(effect.performed) == 12, "the jobs after the cut")
    finally:
        dispatcher.stop()
        runner.join(60)
    assert not runner.is_alive()
    assert set(effect.performed.values()) == {1}
