"""AsyncDispatcher in-process against real PostgreSQL: the same guarantees as Dispatcher
on one event loop. Crashes and stalls of real processes are in tests/crash (flavour
``async``)."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Coroutine
from typing import Any, TypeVar

import psycopg
import pytest

import outbox
from outbox import AsyncDispatcher, Dispatcher, DispatcherFailed, Effect, Job, NewJob
from outbox.observe import AttemptOutcome, DispatchObserver
from outbox.testing import jobs, ledger

from .helpers import fetch, wait_until

T = TypeVar("T")


def enqueue(dsn: str, schema: str, *items: NewJob) -> None:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue_many(items)


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


class AsyncRecord(Effect):
    name = "test.async_record"

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.called = asyncio.Event()

    async def perform(self, job: Job) -> dict[str, Any]:
        self.calls[job.key] += 1
        self.called.set()
        await asyncio.sleep(0)
        return {"key": job.key, "attempt": job.attempt}


class SyncRecord(Effect):
    name = "test.sync_record"

    def __init__(self) -> None:
        self.threads: set[str] = set()
        self.lock = threading.Lock()

    def perform(self, job: Job) -> dict[str, Any]:
        with self.lock:
            self.threads.add(threading.current_thread().name)
        return {"key": job.key}


class Scripted(Effect):
    """Raises the scripted outcome for each attempt, then succeeds (async)."""

    name = "test.scripted"

    def __init__(self, script: list[BaseException]) -> None:
        self.script = script
        self.attempts: list[int] = []

    async def perform(self, job: Job) -> None:
        self.attempts.append(job.attempt)
        if job.attempt <= len(self.script):
            raise self.script[job.attempt - 1]


def test_drains_async_and_sync_effects_with_their_ledger_rows(dsn: str, schema: str) -> None:
    enqueue(dsn, schema, *[NewJob("test.async_record", f"a{i}", {}) for i in range(30)],
            *[NewJob("test.sync_record", f"s{i}", {}) for i in range(30)])
    async_effect, sync_effect = AsyncRecord(), SyncRecord()
    stats = run(AsyncDispatcher(dsn, [async_effect, sync_effect], schema=schema,
                                concurrency=4).run_until_idle(timeout=30))
    assert (stats.claimed, stats.done) == (60, 60)
    assert {j["status"] for j in jobs(dsn, schema).values()} == {"done"}
    assert ledger(dsn, schema)["a7"]["result"] == {"key": "a7", "attempt": 1}
    assert async_effect.calls == {f"a{i}": 1 for i in range(30)}
    # Sync effects ran on the dispatcher's bounded pool, never on the event loop.
    assert sync_effect.threads and all(t.startswith("outbox-worker") for t in sync_effect.threads)
    assert len(sync_effect.threads) <= 4


def test_retry_permanent_and_unknown_outcomes(dsn: str, schema: str) -> None:
    enqueue(dsn, schema, NewJob("test.scripted", "retried", {}))
    effect = Scripted([outbox.Retry(after=0), RuntimeError("boom")])
    run(AsyncDispatcher(dsn, [effect], schema=schema,
                        backoff=outbox.Backoff(base=0.001, cap=0.001)).run_until_idle(30))
    job = jobs(dsn, schema)["retried"]
    assert (job["status"], job["attempts"], job["claim_version"]) == ("done", 3, 3)
    assert effect.attempts == [1, 2, 3]

    enqueue(dsn, schema, NewJob("test.scripted", "refused", {}))
    stats = run(AsyncDispatcher(dsn, [Scripted([outbox.Permanent("card_declined")])],
                                schema=schema).run_until_idle(30))
    assert stats.failed == 1
    refused = jobs(dsn, schema)["refused"]
    assert (refused["status"], refused["last_error"]) == ("failed", "Permanent: card_declined")

    enqueue(dsn, schema, NewJob("test.scripted", "unknown", {}))
    stats = run(AsyncDispatcher(dsn, [Scripted([outbox.UnknownOutcome("timeout")] * 3)],
                                schema=schema, unknown_outcome_window=0).run_until_idle(30))
    assert stats.reconcile == 1
    assert jobs(dsn, schema)["unknown"]["status"] == "reconcile"
    assert set(ledger(dsn, schema)) == {"retried"}


class Stall(Effect):
    """Attempt 1 blocks the event loop itself (no heartbeat can run) until released."""

    name = "test.stall"

    def __init__(self) -> None:
        self.stalled = threading.Event()
        self.resume = threading.Event()

    async def perform(self, job: Job) -> dict[str, int]:
        if job.attempt == 1:
            self.stalled.set()
            self.resume.wait(60)  # a blocking call in async code: the whole loop stalls
        return {"attempt": job.attempt}


def test_a_stalled_loop_finds_its_claim_fenced(dsn: str, schema: str) -> None:
    enqueue(dsn, schema, NewJob("test.stall", "k", {}))
    effect = Stall()
    stale = AsyncDispatcher(dsn, [effect], schema=schema, lease=1)
    result: list[outbox.DispatchStats] = []
    thread = threading.Thread(target=lambda: result.append(run(stale.run_until_idle(60))))
    thread.start()
    try:
        assert effect.stalled.wait(30)
        # Another dispatcher waits for the lease to lapse, rescues the job and does it.
        rescuer = Dispatcher(dsn, [Stall()], schema=schema, lease=1).run_until_idle(30)
        assert (rescuer.rescued, rescuer.done) == (1, 1)
    finally:
        effect.resume.set()
        thread.join(60)
    assert (result[0].done, result[0].stale_completions) == (0, 1)
    job = jobs(dsn, schema)["k"]
    assert (job["status"], job["attempts"], job["claim_version"]) == ("done", 2, 2)
    assert ledger(dsn, schema)["k"]["result"] == {"attempt": 2}


class Blocking(Effect):
    name = "test.blocking"

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.release = asyncio.Event()

    async def perform(self, job: Job) -> dict[str, str]:
        self.started.set()
        await self.release.wait()
        return {"key": job.key}


def test_cancelling_run_finishes_in_flight_work_and_hands_back_the_rest(
    dsn: str, schema: str
) -> None:
    enqueue(dsn, schema, *[NewJob("test.blocking", f"k{i}", {}) for i in range(5)])
    effect = Blocking()
    dispatcher = AsyncDispatcher(dsn, [effect], schema=schema, concurrency=1, prefetch=2)

    async def scenario() -> None:
        task = asyncio.create_task(dispatcher.run())
        await asyncio.wait_for(effect.started.wait(), 30)
        task.cancel()
        effect.release.set()  # the cancelled run waits for the job in flight
        with pytest.raises(asyncio.CancelledError):
            await task

    run(scenario())
    statuses = Counter(j["status"] for j in jobs(dsn, schema).values())
    assert statuses == {"done": 1, "pending": 4}
    assert all(j["attempts"] == 0 for j in jobs(dsn, schema).values() if j["status"] == "pending")
    assert (dispatcher.stats.done, dispatcher.stats.released) == (1, 2)


def test_a_second_cancellation_abandons_work_in_flight_to_the_rescuer(
    dsn: str, schema: str
) -> None:
    enqueue(dsn, schema, NewJob("test.blocking", "k", {}))
    effect = Blocking()  # never released: only abandoning can end the run
    dispatcher = AsyncDispatcher(dsn, [effect], schema=schema, lease=1)

    async def scenario() -> bool:
        task = asyncio.create_task(dispatcher.run())
        await asyncio.wait_for(effect.started.wait(), 30)
        task.cancel()  # drains: would wait for the effect forever
        await asyncio.to_thread(wait_until, lambda: dispatcher._state is not None
                                and dispatcher._state.releasing, what="draining")
        task.cancel()  # abandons
        await asyncio.wait({task}, timeout=30)
        return task.cancelled()

    assert run(scenario())
    assert jobs(dsn, schema)["k"]["status"] == "running"  # left to the rescuer

    class Quick(Effect):
        name = "test.blocking"

        async def perform(self, job: Job) -> dict[str, int]:
            return {"attempt": job.attempt}

    stats = run(AsyncDispatcher(dsn, [Quick()], schema=schema, lease=1).run_until_idle(30))
    assert (stats.rescued, stats.done) == (1, 1)
    assert ledger(dsn, schema)["k"]["result"] == {"attempt": 2}


def test_a_claim_in_flight_when_cancelled_completes_and_is_handed_back(
    dsn: str, schema: str
) -> None:
    enqueue(dsn, schema, *[NewJob("test.async_record", f"k{i}", {}) for i in range(3)])
    effect = AsyncRecord()
    dispatcher = AsyncDispatcher(dsn, [effect], schema=schema)
    # This test's claimer only: another test's may wait on a lock of its own meanwhile.
    waiting = ("SELECT 1 FROM pg_stat_activity WHERE application_name LIKE "
               "'outbox claimer %%' AND wait_event_type = 'Lock' AND position(%s in query) > 0")

    async def scenario() -> None:
        with psycopg.connect(dsn) as locker:
            # The claimer's next statement waits for this lock: a round in flight.
            locker.execute(f'LOCK TABLE "{schema}".jobs IN EXCLUSIVE MODE')
            task = asyncio.create_task(dispatcher.run())
            await asyncio.to_thread(
                wait_until, lambda: bool(fetch(dsn, waiting, (f'"{schema}"',))),
                what="the claimer blocked mid-round")
            task.cancel()
            await asyncio.to_thread(locker.rollback)
        await asyncio.wait({task}, timeout=30)
        assert task.cancelled()

    run(scenario())
    # The round finished: its jobs were claimed, then handed back unstarted.
    rows = jobs(dsn, schema).values()
    assert {(j["status"], j["attempts"], j["claim_version"]) for j in rows} == {
        ("pending", 0, 1)}
    assert (dispatcher.stats.claimed, dispatcher.stats.released) == (3, 3)
    assert effect.calls == {}


def test_async_with_runs_until_the_block_ends_and_wakes_on_notify(
    dsn: str, schema: str
) -> None:
    effect = AsyncRecord()
    dispatcher = AsyncDispatcher(dsn, [effect], schema=schema, poll_interval=3600)

    async def scenario() -> None:
        async with dispatcher:
            await asyncio.to_thread(wait_until, lambda: bool(fetch(
                dsn, "SELECT 1 FROM pg_stat_activity WHERE application_name LIKE "
                "'outbox listener %%' AND query LIKE 'LISTEN%%'")), what="listener")
            await asyncio.to_thread(enqueue, dsn, schema,
                                    NewJob("test.async_record", "k", {}))
            # Polling is an hour away: only the notification can make this happen.
            await effect.called.wait()

    run(asyncio.wait_for(scenario(), 30))
    assert dispatcher.stats.done == 1
    assert jobs(dsn, schema)["k"]["status"] == "done"


def test_stop_from_another_thread_ends_run(dsn: str, schema: str) -> None:
    enqueue(dsn, schema, NewJob("test.async_record", "k", {}))
    done = threading.Event()

    class Finished(DispatchObserver):
        def attempt_finished(self, effect: str, outcome: AttemptOutcome, d: float) -> None:
            done.set()

    dispatcher = AsyncDispatcher(dsn, [AsyncRecord()], schema=schema, observer=Finished())
    def stop_when_done() -> None:
        assert done.wait(30)
        dispatcher.stop()

    stopper = threading.Thread(target=stop_when_done)
    stopper.start()
    stats = run(asyncio.wait_for(dispatcher.run(), 30))
    stopper.join()
    assert stats.done == 1


def test_stop_before_run_is_honoured(dsn: str, schema: str) -> None:
    enqueue(dsn, schema, NewJob("test.async_record", "k", {}))
    dispatcher = AsyncDispatcher(dsn, [AsyncRecord()], schema=schema)
    dispatcher.stop()
    assert run(asyncio.wait_for(dispatcher.run(), 30)).claimed == 0
    assert jobs(dsn, schema)["k"]["status"] == "pending"


class KillsTheRecorder(DispatchObserver):
    def attempt_finished(self, effect: str, outcome: AttemptOutcome, duration: float) -> None:
        raise KeyboardInterrupt  # not an Exception: it kills the recorder task


def test_a_dead_recorder_task_stops_the_dispatcher_loudly(dsn: str, schema: str) -> None:
    enqueue(dsn, schema, *[NewJob("test.async_record", f"k{i}", {}) for i in range(5)])
    dispatcher = AsyncDispatcher(dsn, [AsyncRecord()], schema=schema,
                                 observer=KillsTheRecorder())
    with pytest.raises(DispatcherFailed) as raised:
        run(asyncio.wait_for(dispatcher.run_until_idle(30), 60))
    assert isinstance(raised.value.__cause__, KeyboardInterrupt)


def test_one_limit_across_sync_and_async_effects(dsn: str, schema: str) -> None:
    limit = 3
    lock = threading.Lock()
    gate = threading.Event()
    state = {"in_flight": 0, "peak": 0}

    def enter() -> None:
        with lock:
            state["in_flight"] += 1
            state["peak"] = max(state["peak"], state["in_flight"])

    def leave() -> None:
        with lock:
            state["in_flight"] -= 1

    class SyncGated(Effect):
        name = "test.sync_gated"

        def perform(self, job: Job) -> None:
            enter()
            gate.wait(60)
            leave()

    class AsyncGated(Effect):
        name = "test.async_gated"

        async def perform(self, job: Job) -> None:
            enter()
            await asyncio.get_running_loop().run_in_executor(None, gate.wait, 60)
            leave()

    enqueue(dsn, schema, *[NewJob("test.sync_gated", f"s{i}", {}) for i in range(limit)],
            *[NewJob("test.async_gated", f"a{i}", {}) for i in range(limit)])
    dispatcher = AsyncDispatcher(dsn, [SyncGated(), AsyncGated()], schema=schema,
                                 concurrency=limit, prefetch=limit)

    async def scenario() -> outbox.DispatchStats:
        task = asyncio.create_task(dispatcher.run_until_idle(60))
        await asyncio.to_thread(wait_until, lambda: dispatcher._state is not None)
        assert dispatcher._state is not None
        slots = dispatcher._state.slots
        # Every job is performing or waiting for a slot: nothing else can start.
        await asyncio.to_thread(wait_until, lambda: state["in_flight"] + slots.waiting
                                == 2 * limit, what="all handed over")
        assert (state["in_flight"], state["peak"], slots.waiting) == (limit, limit, limit)
        gate.set()
        return await task

    try:
        stats = run(asyncio.wait_for(scenario(), 60))
    finally:
        gate.set()
    assert stats.done == 2 * limit
    assert state["peak"] == limit


def test_async_effects_run_on_the_dispatchers_loop_in_at_most_concurrency_tasks(
    dsn: str, schema: str
) -> None:
    jobs_count, concurrency = 120, 4

    class Where(Effect):
        name = "test.where"

        def __init__(self) -> None:
            self.loops: set[int] = set()
            self.threads: set[int] = set()
            self.tasks: set[asyncio.Task[Any] | None] = set()
            self.calls: Counter[str] = Counter()
            self.in_flight = self.peak = 0

        async def perform(self, job: Job) -> None:
            self.loops.add(id(asyncio.get_running_loop()))
            self.threads.add(threading.get_ident())
            self.tasks.add(asyncio.current_task())
            self.calls[job.key] += 1
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
            await asyncio.sleep(0.001)
            self.in_flight -= 1

    enqueue(dsn, schema, *[NewJob("test.where", f"k{i}", {}) for i in range(jobs_count)])
    effect = Where()

    async def scenario() -> tuple[outbox.DispatchStats, int, int]:
        # One claim takes every job: all of them wait for a slot from the start.
        dispatcher = AsyncDispatcher(dsn, [effect], schema=schema, concurrency=concurrency,
                                     prefetch=jobs_count, batch_size=jobs_count)
        stats = await dispatcher.run_until_idle(60)
        return stats, id(asyncio.get_running_loop()), threading.get_ident()

    stats, loop, thread = run(scenario())
    assert stats.done == jobs_count
    assert effect.calls == {f"k{i}": 1 for i in range(jobs_count)}
    assert (effect.loops, effect.threads) == ({loop}, {thread})  # no hop to another loop
    assert effect.peak == concurrency
    # A task that finishes a job takes the next waiting one: no task per job.
    assert len(effect.tasks) == concurrency


def test_refuses_an_unmigrated_schema(dsn: str) -> None:
    with pytest.raises(outbox.SchemaError, match="run `outbox migrate`"):
        run(AsyncDispatcher(dsn, [AsyncRecord()], schema="never_migrated").run_until_idle(5))


def test_same_options_checked_the_same_way(dsn: str) -> None:
    with pytest.raises(outbox.ConfigurationError, match="lease must be at least 1.0 seconds"):
        AsyncDispatcher(dsn, [AsyncRecord()], lease=0.5)
    assert AsyncDispatcher(dsn, [AsyncRecord()], lease=2).lease == 2.0


def _readme_example() -> str:
    from pathlib import Path

    page = Path(__file__).resolve().parents[2] / "docs" / "how-to" / "async.md"
    section = page.read_text().split("# AsyncDispatcher", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_readme_fastapi_lifespan_drains_and_stops(
    dsn: str, schema: str, fake_email: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from effects.email import SendEmail

    monkeypatch.setenv("OUTBOX_DATABASE_URL", dsn)
    monkeypatch.setenv("RESEND_API_KEY", "re_test_key")
    namespace: dict[str, Any] = {}
    exec(compile(_readme_example(), "docs/how-to/async.md", "exec"), namespace)
    assert isinstance(namespace["dispatcher"], AsyncDispatcher)
    # The same lifespan, with the dispatcher pointed at this test's schema and fake Resend.
    adapter = SendEmail(api_key="re_test_key", base_url=fake_email.url)
    dispatcher = AsyncDispatcher(dsn, [adapter], schema=schema)
    namespace["dispatcher"] = dispatcher
    app = namespace["app"]

    async def serve() -> None:  # what the server does with the app's lifespan
        async with app.router.lifespan_context(app):
            await asyncio.to_thread(enqueue, dsn, schema, NewJob(
                "email.send", "email-order-102", {"from": "shop@example.com",
                "to": "ada@example.com", "subject": "Order 102", "text": "Thank you!"}))
            await asyncio.to_thread(
                wait_until, lambda: jobs(dsn, schema)["email-order-102"]["status"] == "done",
                what="the email sent by the app's dispatcher")

    run(asyncio.wait_for(serve(), 60))
    assert dispatcher.stats.done == 1  # the lifespan's exit stopped and awaited run()
    assert fake_email.performed("email-order-102") == 1
    adapter.close()
