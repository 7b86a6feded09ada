"""The threads and connections a fleet's turns share (``outbox._dispatch.crew``): a crew
reuses its idle threads and grows only to the parts running at once; a pool reuses a
connection per (connection string, role), never holds more than its capacity, and
never hands out one that is broken, closed or inside a transaction. And the fleet's
schedule leaves a polled target's chores to its look."""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from typing import Any

import psycopg

from outbox import Target
from outbox._dispatch.crew import AsyncPool, Crew, Pool
from outbox._dispatch.fleet import CHORES_EVERY, Schedule, TargetState
from outbox.observe import DispatchObserver


def test_parts_one_after_another_run_on_one_thread() -> None:
    crew = Crew("test-crew")
    names: list[str] = []
    try:
        for n in range(20):
            run = crew.start(lambda: names.append(threading.current_thread().name),
                             f"part-{n}")
            run.join(30)
            assert not run.is_alive()
    finally:
        crew.close()
    assert crew.threads_started == 1
    assert names == [f"part-{n}" for n in range(20)]  # each named as its part


def test_a_crew_grows_to_the_parts_running_at_once_and_no_further() -> None:
    crew = Crew("test-crew")
    release = threading.Event()
    started = threading.Semaphore(0)

    def part() -> None:
        started.release()
        release.wait(30)

    try:
        for _round in range(3):
            runs = [crew.start(part, "blocked") for _ in range(5)]
            for _ in runs:
                assert started.acquire(timeout=30)  # all five run at once
            release.set()
            for run in runs:
                run.join(30)
                assert not run.is_alive()
            release.clear()
    finally:
        crew.close()
    assert crew.threads_started == 5


def test_a_part_that_raises_leaves_its_thread_serving() -> None:
    crew = Crew("test-crew")
    done = threading.Event()

    def fails() -> None:
        raise RuntimeError("boom")

    try:
        crew.start(fails, "fails").join(30)
        crew.start(done.set, "after").join(30)
    finally:
        crew.close()
    assert done.is_set() and crew.threads_started == 1


def test_a_part_sees_no_context_variable_a_previous_part_set() -> None:
    crew = Crew("test-crew")
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="fresh")
    seen: list[str] = []
    try:
        crew.start(lambda: var.set("left over"), "sets").join(30)
        crew.start(lambda: seen.append(var.get()), "reads").join(30)
    finally:
        crew.close()
    assert crew.threads_started == 1 and seen == ["fresh"]


def _opener(dsn: str, opened: list[psycopg.Connection[Any]]) -> Any:
    def open_() -> psycopg.Connection[Any]:
        conn = psycopg.connect(dsn, autocommit=True)
        opened.append(conn)
        return conn
    return open_


def test_a_pool_reuses_a_connection_of_the_same_key_only(dsn: str) -> None:
    pool, opened = Pool(4), list[psycopg.Connection[Any]]()
    open_ = _opener(dsn, opened)
    try:
        first = pool.take((dsn, "claimer"), open_)
        pool.give(first)
        assert pool.take((dsn, "claimer"), open_) is first
        other = pool.take((dsn, "recorder"), open_)
        assert other is not first and len(opened) == 2 and pool.opened == 2
        pool.give(first)
        pool.give(other)
    finally:
        pool.close()
    assert all(conn.closed for conn in opened)


def test_a_pool_never_holds_more_than_its_capacity(dsn: str) -> None:
    pool, opened = Pool(2), list[psycopg.Connection[Any]]()
    open_ = _opener(dsn, opened)
    try:
        for role in ("a", "b", "c", "d"):
            conn = pool.take((dsn, role), open_)
            assert pool.held() <= 2
            pool.give(conn)
            assert pool.held() <= 2
        assert sum(not conn.closed for conn in opened) == 2
        pool.capacity = 1  # the budget left shrank: the oldest idle one goes
        pool.give(pool.take((dsn, "d"), open_))
        assert pool.held() == 1 and sum(not conn.closed for conn in opened) == 1
    finally:
        pool.close()


def test_a_pool_drops_a_connection_broken_closed_or_in_a_transaction(dsn: str) -> None:
    pool, opened = Pool(4), list[psycopg.Connection[Any]]()
    open_ = _opener(dsn, opened)
    try:
        in_transaction = pool.take((dsn, "x"), open_)
        in_transaction.autocommit = False
        in_transaction.execute("SELECT 1")  # a transaction left open
        pool.give(in_transaction)
        assert in_transaction.closed and pool.held() == 0

        ended = pool.take((dsn, "x"), open_)
        pool.give(ended)
        row = ended.execute("SELECT pg_backend_pid()").fetchone()
        assert row is not None
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (row[0],))

            def gone() -> bool:
                found = admin.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s",
                                      (row[0],)).fetchone()
                return found is not None and found[0] == 0

            deadline = time.monotonic() + 60
            while not gone():
                assert time.monotonic() < deadline, "the terminated backend never left"
                time.sleep(0.02)
        again = pool.take((dsn, "x"), open_)
        assert again is not ended and ended.closed
        assert again.execute("SELECT 1").fetchone() == (1,)
        pool.give(again)
    finally:
        pool.close()


def test_an_async_pool_reuses_per_key_within_its_capacity(dsn: str) -> None:
    async def scenario() -> None:
        pool = AsyncPool(2)
        made: list[psycopg.AsyncConnection[Any]] = []

        async def open_() -> psycopg.AsyncConnection[Any]:
            conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
            made.append(conn)
            return conn

        try:
            first = await pool.take((dsn, "claimer"), open_)
            await pool.give(first)
            assert await pool.take((dsn, "claimer"), open_) is first
            other = await pool.take((dsn, "recorder"), open_)
            assert other is not first and pool.opened == 2
            await pool.give(first)
            await pool.give(other)
            third = await pool.take((dsn, "reconciler"), open_)  # full: the oldest goes
            assert first.closed and not other.closed and pool.held() == 2
            await third.execute("BEGIN")  # inside a transaction: never kept
            await pool.give(third)
            assert third.closed and pool.held() == 1
        finally:
            await pool.close()
        assert all(conn.closed for conn in made)

    asyncio.run(scenario())


def test_a_connection_being_opened_holds_its_place_in_the_pool(dsn: str) -> None:
    # One idle connection in a pool of two; a take is opening another (outside the
    # pool's lock) when a second take comes: the second sees the pool full and lets the
    # idle one go, so the pool never holds three.
    pool, opened = Pool(2), list[psycopg.Connection[Any]]()
    open_ = _opener(dsn, opened)
    inside, release = threading.Event(), threading.Event()

    def slow_open() -> psycopg.Connection[Any]:
        inside.set()
        release.wait(30)
        conn: psycopg.Connection[Any] = open_()
        return conn

    taken: list[psycopg.Connection[Any]] = []
    try:
        idle = pool.take((dsn, "a"), open_)
        pool.give(idle)
        opener = threading.Thread(
            target=lambda: taken.append(pool.take((dsn, "b"), slow_open)))
        opener.start()
        assert inside.wait(30)
        second = pool.take((dsn, "c"), open_)
        assert idle.closed  # let go for the connection being opened
        release.set()
        opener.join(30)
        assert pool.held() == 2 and sum(not conn.closed for conn in opened) == 2
        pool.give(second)
        pool.give(taken[0])
    finally:
        release.set()
        pool.close()


def test_a_connection_given_back_as_not_recent_is_the_first_to_go(dsn: str) -> None:
    # A look that found no work gives its connection back as the least recently used:
    # the next one opened in a full pool lets it go, not the busy database's.
    pool, opened = Pool(2), list[psycopg.Connection[Any]]()
    open_ = _opener(dsn, opened)
    try:
        busy = pool.take((dsn, "busy"), open_)
        quiet = pool.take((dsn, "quiet"), open_)
        pool.give(busy)
        pool.give(quiet, recent=False)
        pool.give(pool.take((dsn, "next"), open_))
        assert quiet.closed and not busy.closed
    finally:
        pool.close()


def test_a_polled_targets_chores_wait_for_its_look() -> None:
    # Owed its chores, a target of a polled database is not started by the schedule
    # (its look, holding a connection to it, wakes it); a listened-to one is.
    schedule = Schedule(16, 2, DispatchObserver())
    listened = TargetState(Target("dbname=a"), engine=None, due=False, last_turn=1.0)
    polled = TargetState(Target("dbname=b"), engine=None, due=False, last_turn=1.0,
                         polled=True)
    schedule.states = {listened.target: listened, polled.target: polled}
    chosen = schedule.next_turns(1.0 + CHORES_EVERY, until_idle=False)
    assert chosen == [listened]
    polled.due = True  # its look woke it
    assert schedule.next_turns(1.0 + CHORES_EVERY, until_idle=False) == [polled]
