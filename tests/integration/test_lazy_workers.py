"""A run starts only the workers it uses: worker threads as jobs are handed over (one at a
time, only while work waits that no thread already started is idle to take; never more
than ``concurrency``), the event loop for async effects with the first async job; and a
perform that hangs holds up none of the jobs behind it. Threads are counted as they
start (every ``threading.Thread.start`` of the run is recorded by name)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import psycopg
import pytest

import outbox
from outbox import AsyncDispatcher, Dispatcher, Effect, Job, NewJob
from outbox.testing import jobs

from .helpers import wait_until

RUN_WITHIN = 60.0  # generous: a loaded machine


def enqueue(dsn: str, schema: str, *items: NewJob) -> None:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue_many(items)


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The names of the threads started from now on, in order."""
    names: list[str] = []
    lock = threading.Lock()
    start = threading.Thread.start

    def recorded(thread: threading.Thread) -> None:
        with lock:
            names.append(thread.name)
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", recorded)
    yield names


def workers(names: list[str]) -> list[str]:
    return [name for name in names if name.startswith("outbox-worker-")]


class Waits(Effect):
    """Slow: each perform waits at ``barrier`` until ``parties`` performs are in flight
    together, counting the most in flight at once (``peak``), then works ``WORK``
    seconds. The work keeps the effect measured slow: the barrier alone can release a
    wave within a millisecond, and an effect measured that fast has a large batch handed
    to threads in runs of several jobs (``workers.FAST_EFFECT``), fewer runs than
    ``parties``: a wave that never fills, and a broken barrier."""

    WORK = 0.01

    name = "test.waits"

    def __init__(self, parties: int) -> None:
        self.barrier = threading.Barrier(parties, timeout=RUN_WITHIN)
        self.lock = threading.Lock()
        self.in_flight = 0
        self.peak = 0
        self.threads: set[str] = set()

    def perform(self, job: Job) -> None:
        with self.lock:
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
            self.threads.add(threading.current_thread().name)
        try:
            self.barrier.wait()
            time.sleep(self.WORK)  # the effect's own work, not a wait for anything
        finally:
            with self.lock:
                self.in_flight -= 1


class Quick(Effect):
    name = "test.quick"

    def perform(self, job: Job) -> None:
        return None


class AsyncQuick(Effect):
    name = "test.async_quick"

    async def perform(self, job: Job) -> None:
        return None


def test_three_slow_jobs_start_three_worker_threads_of_64(
    dsn: str, schema: str, started: list[str],
) -> None:
    """Three jobs performing at once (they meet at a barrier of three) on a dispatcher
    of concurrency 64: three worker threads are started, not 64."""
    effect = Waits(3)
    enqueue(dsn, schema, *[NewJob(effect.name, f"k{i}", {}) for i in range(3)])
    dispatcher = Dispatcher(dsn, [effect], schema=schema, concurrency=64)
    assert dispatcher.run_until_idle(timeout=RUN_WITHIN).done == 3
    assert effect.peak == 3  # all three at once: each on a thread of its own
    assert len(workers(started)) == 3, started
    assert effect.threads == set(workers(started))


def test_a_run_with_no_job_starts_no_worker(dsn: str, schema: str, started: list[str]) -> None:
    """Nothing claimed: no worker thread and no event loop for the async effects, while
    the run's other parts start as always (the count sees threads)."""
    dispatcher = Dispatcher(dsn, [Quick(), AsyncQuick()], schema=schema, concurrency=64)
    assert dispatcher.run_until_idle(timeout=RUN_WITHIN).done == 0
    assert "outbox-recorder" in started
    assert not workers(started) and "outbox-async" not in started, started


def test_the_event_loop_starts_with_the_first_async_job(
    dsn: str, schema: str, started: list[str],
) -> None:
    """A run of sync jobs alone starts no event loop though async effects are
    registered; the run that claims an async job starts one, and performs it."""
    dispatcher = Dispatcher(dsn, [Quick(), AsyncQuick()], schema=schema, concurrency=64)
    enqueue(dsn, schema, *[NewJob("test.quick", f"s{i}", {}) for i in range(5)])
    assert dispatcher.run_until_idle(timeout=RUN_WITHIN).done == 5
    assert "outbox-async" not in started and 1 <= len(workers(started)) <= 5, started
    started.clear()
    enqueue(dsn, schema, NewJob("test.async_quick", "a", {}),
            NewJob("test.quick", "s-last", {}))
    assert dispatcher.run_until_idle(timeout=RUN_WITHIN).done == 2
    assert started.count("outbox-async") == 1, started
    assert {j["status"] for j in jobs(dsn, schema).values()} == {"done"}


def test_concurrency_is_still_the_limit(dsn: str, schema: str, started: list[str]) -> None:
    """64 slow jobs, concurrency 8: they perform in waves of eight (a barrier of eight
    parties: each wave is eight at once), never more than eight in flight, on at most
    eight threads."""
    limit = 8
    effect = Waits(limit)
    enqueue(dsn, schema, *[NewJob(effect.name, f"k{i}", {}) for i in range(64)])
    dispatcher = Dispatcher(dsn, [effect], schema=schema, concurrency=limit)
    assert dispatcher.run_until_idle(timeout=RUN_WITHIN).done == 64
    assert effect.peak == limit
    assert len(workers(started)) == limit, started


def test_async_dispatchers_threads_for_sync_effects_start_as_jobs_come(
    dsn: str, schema: str, started: list[str],
) -> None:
    """``AsyncDispatcher`` runs sync effects on the same pool: no thread for a run with
    no job, three for three slow jobs at once, not 64."""
    effect = Waits(3)
    dispatcher = AsyncDispatcher(dsn, [effect], schema=schema, concurrency=64)
    assert asyncio.run(dispatcher.run_until_idle(RUN_WITHIN)).done == 0
    assert not workers(started), started
    enqueue(dsn, schema, *[NewJob(effect.name, f"k{i}", {}) for i in range(3)])
    assert asyncio.run(dispatcher.run_until_idle(RUN_WITHIN)).done == 3
    assert effect.peak == 3
    assert len(workers(started)) == 3, started


class HangsFirst(Effect):
    """The job with key "stuck" waits until released; the others return at once."""

    name = "test.hangs_first"

    def __init__(self) -> None:
        self.hanging = threading.Event()
        self.release = threading.Event()

    def perform(self, job: Job) -> None:
        if job.key == "stuck":
            self.hanging.set()
            self.release.wait(RUN_WITHIN)


def test_a_perform_that_hangs_holds_up_none_of_the_jobs_behind_it(
    dsn: str, schema: str,
) -> None:
    """Threads start one at a time, yet the jobs claimed with a hanging one are all
    performed while it hangs (the thread that took it started the next first)."""
    effect = HangsFirst()
    enqueue(dsn, schema, NewJob(effect.name, "stuck", {}),
            *[NewJob(effect.name, f"k{i}", {}) for i in range(5)])
    dispatcher = Dispatcher(dsn, [effect], schema=schema, concurrency=4)
    runner = threading.Thread(target=dispatcher.run_until_idle, args=(RUN_WITHIN,))
    runner.start()
    try:
        assert effect.hanging.wait(RUN_WITHIN)
        wait_until(lambda: sum(j["status"] == "done" for j in jobs(dsn, schema).values()) == 5,
                   what="the five other jobs done while one hangs")
        assert jobs(dsn, schema)["stuck"]["status"] == "running"
    finally:
        effect.release.set()
        runner.join(RUN_WITHIN)
    assert not runner.is_alive()
    assert {j["status"] for j in jobs(dsn, schema).values()} == {"done"}
