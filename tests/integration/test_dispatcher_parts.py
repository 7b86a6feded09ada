"""The dispatcher's parts against real PostgreSQL: the observer's events, supervision of
the side threads, the one concurrency limit, and the recorder staged without threads."""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from collections import Counter
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import psycopg
import pytest

import outbox
import outbox.sql
from outbox import Dispatcher, DispatcherFailed, DispatchStats, Effect, Job, NewJob
from outbox._dispatch import statistics, vacuum
from outbox._dispatch.claimer import Claimer, claim_executor
from outbox._dispatch.connection import Connection, connect, connect_async
from outbox._dispatch.recorder import Recorder
from outbox._dispatch.rescuer import Rescuer
from outbox._dispatch.settings import Settings
from outbox._dispatch.state import Held, Outcome, SharedState, Success
from outbox._steps import execute, run
from outbox.observe import AttemptOutcome, DispatchObserver
from outbox.testing import jobs, ledger

from .helpers import wait_until


def enqueue(dsn: str, schema: str, *items: NewJob) -> None:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue_many(items)


class Events(DispatchObserver):
    """Keeps every event it hears."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.waits: list[tuple[str, float]] = []
        self.started: Counter[str] = Counter()
        self.finished: Counter[tuple[str, AttemptOutcome]] = Counter()
        self.fenced: Counter[str] = Counter()
        self.rescues = 0

    def claimed(self, duration: float, waits: Sequence[tuple[str, float]]) -> None:
        assert duration >= 0
        with self.lock:
            self.waits.extend(waits)

    def attempt_started(self, effect: str) -> None:
        with self.lock:
            self.started[effect] += 1

    def attempt_finished(self, effect: str, outcome: AttemptOutcome, duration: float) -> None:
        assert duration >= 0
        with self.lock:
            self.finished[effect, outcome] += 1

    def fence_rejected(self, effect: str) -> None:
        with self.lock:
            self.fenced[effect] += 1

    def rescued(self, count: int) -> None:
        with self.lock:
            self.rescues += count


class ByPayload(Effect):
    """Raises what the payload names on the given attempts, else succeeds."""

    name = "test.by_payload"

    def perform(self, job: Job) -> dict[str, int]:
        failing = job.payload.get("fail_attempts", [])
        if job.attempt in failing:
            raise {"retry": outbox.Retry(after=0), "permanent": outbox.Permanent("no"),
                   "unknown": outbox.UnknownOutcome("timeout")}[job.payload["raise"]]
        return {"attempt": job.attempt}


def test_observer_hears_claims_attempts_and_outcomes(dsn: str, schema: str) -> None:
    enqueue(dsn, schema,
            NewJob("test.by_payload", "ok", {}),
            NewJob("test.by_payload", "retried", {"raise": "retry", "fail_attempts": [1]}),
            NewJob("test.by_payload", "refused", {"raise": "permanent", "fail_attempts": [1]}),
            NewJob("test.by_payload", "unknown", {"raise": "unknown", "fail_attempts": [1]}))
    with psycopg.connect(dsn, autocommit=True) as conn:  # no attempt left: reconcile at once
        conn.execute(f'UPDATE "{schema}".jobs SET max_attempts = 1 WHERE key = \'unknown\'')
    events = Events()
    stats = Dispatcher(dsn, [ByPayload()], schema=schema, observer=events).run_until_idle(30)
    assert {k: j["status"] for k, j in jobs(dsn, schema).items()} == {
        "ok": "done", "retried": "done", "refused": "failed", "unknown": "reconcile"}
    effect = "test.by_payload"
    assert events.started == {effect: 5}
    assert events.finished == {(effect, "done"): 2, (effect, "retry"): 1,
                               (effect, "failed"): 1, (effect, "reconcile"): 1}
    assert [e for e, _ in events.waits] == [effect] * 5
    assert all(wait >= 0 for _, wait in events.waits)
    assert (stats.done, stats.retried, stats.failed, stats.reconcile) == (2, 1, 1, 1)


def test_observer_hears_rescues_and_fence_rejections(dsn: str, schema: str) -> None:
    enqueue(dsn, schema, NewJob("test.by_payload", "k", {}))
    with psycopg.connect(dsn, autocommit=True) as conn:  # a worker that claimed, then died
        conn.execute(outbox.sql.queries(schema).claim, {
            "effects": "{test.by_payload}", "limit": 1, "lease": 1.0, "worker": "dead",
            "after": "{}"})
    events = Events()
    Dispatcher(dsn, [ByPayload()], schema=schema, lease=1,
               observer=events).run_until_idle(timeout=30)
    assert events.rescues == 1
    assert events.finished == {("test.by_payload", "done"): 1}
    assert events.fenced == {}


class Raising(DispatchObserver):
    def attempt_started(self, effect: str) -> None:
        raise RuntimeError("observer bug")

    def attempt_finished(self, effect: str, outcome: AttemptOutcome, duration: float) -> None:
        raise RuntimeError("observer bug")


def test_an_observer_that_raises_is_logged_and_ignored(
    dsn: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    enqueue(dsn, schema, *[NewJob("test.by_payload", f"k{i}", {}) for i in range(3)])
    with caplog.at_level(logging.ERROR, logger="outbox.dispatcher"):
        stats = Dispatcher(dsn, [ByPayload()], schema=schema,
                           observer=Raising()).run_until_idle(timeout=30)
    assert stats.done == 3
    assert {j["status"] for j in jobs(dsn, schema).values()} == {"done"}
    assert any("observer" in r.getMessage() and r.exc_info for r in caplog.records)


# -- supervision -------------------------------------------------------------------------


class Fatal(BaseException):
    """Not an Exception: nothing on the way may swallow it as an ordinary error."""


class KillsTheRecorder(DispatchObserver):
    def attempt_finished(self, effect: str, outcome: AttemptOutcome, duration: float) -> None:
        raise Fatal("recorder-side observer crashed")


class KillsAWorker(DispatchObserver):
    def attempt_started(self, effect: str) -> None:
        raise Fatal("worker-side observer crashed")


def test_a_dead_recorder_stops_run_until_idle_loudly(
    dsn: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    enqueue(dsn, schema, *[NewJob("test.by_payload", f"k{i}", {}) for i in range(20)])
    dispatcher = Dispatcher(dsn, [ByPayload()], schema=schema, observer=KillsTheRecorder())
    with pytest.raises(DispatcherFailed) as raised:
        dispatcher.run_until_idle(timeout=60)
    assert isinstance(raised.value.__cause__, Fatal)
    assert any(r.levelno == logging.CRITICAL and "recorder" in r.getMessage()
               for r in caplog.records)
    # What the recorder wrote before it died stays written; the rest is rescued later.
    statuses = Counter(j["status"] for j in jobs(dsn, schema).values())
    assert statuses["done"] >= 1
    assert set(statuses) <= {"done", "running", "pending"}


def test_a_dead_worker_stops_run_loudly_and_its_job_is_rescued(dsn: str, schema: str) -> None:
    enqueue(dsn, schema, NewJob("test.by_payload", "k", {}))
    dispatcher = Dispatcher(dsn, [ByPayload()], schema=schema, lease=1,
                            observer=KillsAWorker())
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            dispatcher.run()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=serve)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], DispatcherFailed)
    assert jobs(dsn, schema)["k"]["status"] == "running"  # held when the worker died
    stats = Dispatcher(dsn, [ByPayload()], schema=schema, lease=1).run_until_idle(timeout=30)
    assert (stats.rescued, stats.done) == (1, 1)
    assert ledger(dsn, schema)["k"]["result"] == {"attempt": 2}


class AsyncByPayload(Effect):
    name = "test.async_by_payload"

    async def perform(self, job: Job) -> dict[str, int]:
        return {"attempt": job.attempt}


def test_a_dead_async_worker_stops_run_until_idle_loudly(dsn: str, schema: str) -> None:
    enqueue(dsn, schema, NewJob("test.async_by_payload", "k", {}))
    dispatcher = Dispatcher(dsn, [AsyncByPayload()], schema=schema, observer=KillsAWorker())
    with pytest.raises(DispatcherFailed) as raised:
        dispatcher.run_until_idle(timeout=60)
    assert isinstance(raised.value.__cause__, Fatal)
    assert jobs(dsn, schema)["k"]["status"] == "running"  # left to the rescuer


# -- one concurrency limit -----------------------------------------------------------------


class Gate:
    """Counts performs in flight (and the peak); each waits until the test opens it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.in_flight = 0
        self.peak = 0
        self.open = threading.Event()

    def enter(self) -> None:
        with self.lock:
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)

    def leave(self) -> None:
        with self.lock:
            self.in_flight -= 1


class SyncGated(Effect):
    name = "test.sync_gated"

    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    def perform(self, job: Job) -> None:
        self.gate.enter()
        self.gate.open.wait(60)
        self.gate.leave()


class AsyncGated(Effect):
    name = "test.async_gated"

    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    async def perform(self, job: Job) -> None:
        self.gate.enter()
        await asyncio.get_running_loop().run_in_executor(None, self.gate.open.wait, 60)
        self.gate.leave()


def test_sync_and_async_effects_share_one_concurrency_limit(dsn: str, schema: str) -> None:
    limit = 4
    enqueue(dsn, schema, *[NewJob("test.sync_gated", f"s{i}", {}) for i in range(limit)],
            *[NewJob("test.async_gated", f"a{i}", {}) for i in range(limit)])
    gate = Gate()
    # Capacity concurrency + prefetch = 8: one claim hands all eight jobs to the workers
    # (four threads, four tasks), each of which could start at once without the limit.
    dispatcher = Dispatcher(dsn, [SyncGated(gate), AsyncGated(gate)], schema=schema,
                            concurrency=limit, prefetch=limit)
    result: list[DispatchStats] = []
    thread = threading.Thread(target=lambda: result.append(dispatcher.run_until_idle(60)))
    thread.start()
    try:
        slots = dispatcher._state.slots
        # Every job is either performing or waiting for a slot: nothing else can start.
        wait_until(lambda: gate.in_flight + slots.waiting == 2 * limit, what="all handed over")
        assert (gate.in_flight, gate.peak, slots.waiting) == (limit, limit, limit)
    finally:
        gate.open.set()
        thread.join(timeout=60)
    assert result[0].done == 2 * limit
    assert gate.peak == limit


# -- the recorder, staged without threads ----------------------------------------------------


# retention 0: the completion deletes the job row, and the ledger row alone tells "my
# own completion landed" apart from "my claim was lost".
@pytest.mark.parametrize("retention", [timedelta(days=7), 0])
def test_a_retried_completion_whose_first_reply_was_lost_counts_as_done(
    dsn: str, schema: str, retention: timedelta | int
) -> None:
    enqueue(dsn, schema, NewJob("test.by_payload", "landed", {}),
            NewJob("test.by_payload", "stolen", {}))
    settings = Settings.build(dsn, [ByPayload()], schema=schema, lease=1, retention=retention)
    events = Events()
    state: SharedState[threading.Event] = SharedState(DispatchStats(), events, 4,
                                                      threading.Event)
    conn = Connection(lambda role: connect(settings, role), "recorder")
    round_ = run(Claimer(settings, state, until_idle=True).round(), claim_executor(conn))
    held = {h.job.key: h for h in round_.batch}
    assert sorted(held) == ["landed", "stolen"]
    with psycopg.connect(dsn, autocommit=True) as other:  # "stolen": rescued, re-claimed
        other.execute(f"UPDATE \"{schema}\".jobs SET lease_until = now() - interval '1 s' "
                      "WHERE key = 'stolen'")
        rescue_now(other, settings)
        other.execute(outbox.sql.queries(schema).claim, {
            "effects": settings.effect_names, "limit": 10, "lease": 30.0, "worker": "other",
            "after": "{}"})
    recorder = Recorder(settings, state)
    pending: list[tuple[Held, Outcome]] = [(h, Success('{"ok":true}')) for h in held.values()]

    # First attempt: the completion commits, then the connection drops before the reply.
    step = recorder.flush(pending)
    conn.execute(next(step))
    lost = psycopg.OperationalError("server closed the connection unexpectedly")
    with pytest.raises(psycopg.OperationalError):
        step.throw(lost)
    recorder.failed(lost, lost=True, pending=pending)
    assert recorder.retrying and len(pending) == 2  # nothing was taken as written

    run(recorder.flush(pending), conn.execute)
    assert pending == []
    assert (state.stats.done, state.stats.stale_completions) == (1, 1)
    assert events.finished == {("test.by_payload", "done"): 1, ("test.by_payload", "lost"): 1}
    assert events.fenced == {"test.by_payload": 1}
    rows = jobs(dsn, schema)
    assert rows["stolen"]["status"] == "running"
    assert rows["stolen"]["claimed_by"] == "other"
    if retention == 0:
        assert "landed" not in rows
    else:
        assert rows["landed"]["status"] == "done"
    assert set(ledger(dsn, schema)) == {"landed"}
    assert ledger(dsn, schema)["landed"]["claim_version"] == held["landed"].job.claim_version
    assert state.held == {}
    conn.discard()


def rescue_now(conn: psycopg.Connection[Any], settings: Settings) -> None:
    """One batch of the rescuer, as the claimer runs it, on ``conn``; the job rescued is
    made due at once (its backoff skipped), for the next claim to take it."""
    run(Rescuer(settings, random.Random()).rescue(settings.queries),
        lambda statement: execute(conn, statement))  # type: ignore[arg-type]
    conn.execute(f'UPDATE "{settings.schema}".jobs SET available_at = now() '
                 "WHERE status = 'pending'")


def _staged_with_stolen_claim(dsn: str, schema: str) -> tuple[
        Settings, SharedState[threading.Event], Events, Connection, dict[str, Held]]:
    """Claims every job with a claimer driven by hand, then has another worker rescue
    and re-claim the job keyed "stolen": its first claim is now stale."""
    settings = Settings.build(dsn, [ByPayload()], schema=schema, lease=1, retention=0)
    events = Events()
    state: SharedState[threading.Event] = SharedState(DispatchStats(), events, 4,
                                                      threading.Event)
    conn = Connection(lambda role: connect(settings, role), "recorder")
    round_ = run(Claimer(settings, state, until_idle=True).round(), claim_executor(conn))
    held = {h.job.key: h for h in round_.batch}
    with psycopg.connect(dsn, autocommit=True) as other:
        other.execute(f"UPDATE \"{schema}\".jobs SET lease_until = now() - interval '1 s' "
                      "WHERE key = 'stolen'")
        rescue_now(other, settings)
        other.execute(outbox.sql.queries(schema).claim, {
            "effects": settings.effect_names, "limit": 10, "lease": 30.0, "worker": "other",
            "after": "{}"})
    return settings, state, events, conn, held


def test_a_stale_completion_deletes_nothing_and_writes_no_ledger_row(
    dsn: str, schema: str
) -> None:
    enqueue(dsn, schema, NewJob("test.by_payload", "stolen", {}))
    settings, state, events, conn, held = _staged_with_stolen_claim(dsn, schema)
    recorder = Recorder(settings, state)
    pending: list[tuple[Held, Outcome]] = [(held["stolen"], Success('{"late":true}'))]
    run(recorder.flush(pending), conn.execute)
    assert pending == []
    assert (state.stats.done, state.stats.stale_completions) == (0, 1)
    assert events.fenced == {"test.by_payload": 1}
    row = jobs(dsn, schema)["stolen"]
    assert (row["status"], row["claimed_by"], row["claim_version"]) == ("running", "other", 2)
    assert ledger(dsn, schema) == {}
    conn.discard()


def test_listen_conninfo_must_be_a_string(dsn: str) -> None:
    with pytest.raises(outbox.ConfigurationError, match="listen_conninfo"):
        Dispatcher(dsn, [ByPayload()], listen_conninfo=5)  # type: ignore[arg-type]
    assert Dispatcher(dsn, [ByPayload()], listen_conninfo=dsn).settings.listen_conninfo == dsn


def test_observer_must_be_a_dispatch_observer(dsn: str) -> None:
    with pytest.raises(outbox.ConfigurationError, match="observer"):
        Dispatcher(dsn, [ByPayload()], observer=object())  # type: ignore[arg-type]


def test_settings_never_show_the_connection_string() -> None:
    secret = "postgresql://app:s3cret-pw@db/app"
    settings = Settings.build(secret, [ByPayload()], listen_conninfo=secret)
    assert "s3cret" not in repr(settings)


def test_a_dispatcher_gives_new_queue_tables_their_first_statistics(
        dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        # Autovacuum must not get there first: this test is about the dispatcher.
        conn.execute(f'ALTER TABLE "{schema}".jobs SET (autovacuum_enabled = false)')
        conn.execute(f'INSERT INTO "{schema}".jobs (effect, key, payload, fingerprint, status) '
                     "SELECT 'test.elsewhere', 'k' || g, '{}', 'f', 'failed' "
                     "FROM generate_series(1, %s) AS g", (statistics.ROWS + 100,))

        def changes() -> int:
            conn.execute("SELECT pg_stat_clear_snapshot()")
            row = conn.execute(
                "SELECT n_mod_since_analyze, last_analyze FROM pg_stat_user_tables "
                "WHERE schemaname = %s AND relname = 'jobs'", (schema,)).fetchone()
            assert row is not None and row[1] is None
            return int(row[0])

        wait_until(lambda: changes() >= statistics.ROWS, what="the inserts counted")
        outbox.Dispatcher(dsn, [ByPayload()], schema=schema).run_until_idle(timeout=30)
        conn.execute("SELECT pg_stat_clear_snapshot()")
        analyzed = conn.execute(
            "SELECT last_analyze IS NOT NULL FROM pg_stat_user_tables "
            "WHERE schemaname = %s AND relname = 'jobs'", (schema,)).fetchone()
        assert analyzed == (True,)


def test_a_young_table_is_analyzed_again_as_it_grows_past_its_statistics(
        dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'ALTER TABLE "{schema}".jobs SET (autovacuum_enabled = false)')
        insert = (f'INSERT INTO "{schema}".jobs (effect, key, payload, fingerprint, status) '
                  "SELECT 'test.elsewhere', %s || g, '{}', 'f', 'failed' "
                  "FROM generate_series(1, %s) AS g")

        def counted() -> tuple[int, int]:
            """Changes since the last ANALYZE, and the rows it counted."""
            conn.execute("SELECT pg_stat_clear_snapshot()")
            row = conn.execute(
                "SELECT s.n_mod_since_analyze, c.reltuples::bigint FROM pg_stat_user_tables s "
                "JOIN pg_class c ON c.oid = s.relid "
                "WHERE s.schemaname = %s AND s.relname = 'jobs'", (schema,)).fetchone()
            assert row is not None
            return int(row[0]), int(row[1])

        conn.execute(insert, ("a", statistics.ROWS + 100))
        wait_until(lambda: counted()[0] >= statistics.ROWS, what="the inserts counted")
        outbox.Dispatcher(dsn, [ByPayload()], schema=schema).run_until_idle(timeout=30)
        assert counted() == (0, statistics.ROWS + 100)
        # Grown by less than twice what the statistics counted: left as it is.
        conn.execute(insert, ("b", statistics.ROWS))
        wait_until(lambda: counted()[0] >= statistics.ROWS, what="the inserts counted")
        outbox.Dispatcher(dsn, [ByPayload()], schema=schema).run_until_idle(timeout=30)
        assert counted() == (statistics.ROWS, statistics.ROWS + 100)
        # Past twice: analyzed again, its statistics counting the table as it is now.
        conn.execute(insert, ("c", 3 * statistics.ROWS))
        wait_until(lambda: counted()[0] >= 4 * statistics.ROWS, what="the inserts counted")
        outbox.Dispatcher(dsn, [ByPayload()], schema=schema).run_until_idle(timeout=30)
        assert counted() == (0, 5 * statistics.ROWS + 100)


def _dead_rows_in_jobs(conn: psycopg.Connection[tuple[Any, ...]], schema: str, rows: int) -> None:
    """Leave ``rows`` dead row versions in the jobs table (autovacuum kept away), counted
    by the statistics."""
    conn.execute(f'ALTER TABLE "{schema}".jobs SET (autovacuum_enabled = false)')
    conn.execute(f'INSERT INTO "{schema}".jobs (effect, key, payload, fingerprint, status) '
                 "SELECT 'test.elsewhere', 'dead' || g, '{}', 'f', 'failed' "
                 "FROM generate_series(1, %s) AS g", (rows,))
    conn.execute(f"DELETE FROM \"{schema}\".jobs WHERE key LIKE 'dead%%'")
    wait_until(lambda: _vacuum_state(conn, schema)[0] >= rows, what="the dead rows counted")


def _vacuum_state(conn: psycopg.Connection[tuple[Any, ...]], schema: str,
                  ) -> tuple[int, bool]:
    """The jobs table's dead rows, and whether a VACUUM (not autovacuum) ran on it."""
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute("SELECT n_dead_tup, last_vacuum IS NOT NULL FROM pg_stat_user_tables "
                       "WHERE schemaname = %s AND relname = 'jobs'", (schema,)).fetchone()
    assert row is not None
    return int(row[0]), bool(row[1])


def test_a_running_dispatcher_vacuums_a_queue_table_that_autovacuum_has_not_reached(
        dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        _dead_rows_in_jobs(conn, schema, vacuum.ROWS + 1000)
        dispatcher = outbox.Dispatcher(dsn, [ByPayload()], schema=schema)
        thread = threading.Thread(target=dispatcher.run)
        thread.start()
        try:
            # Its first round looks: the vacuum runs on a thread of its own, and the
            # statistics say so once it has ended.
            wait_until(lambda: _vacuum_state(conn, schema)[1], what="the jobs table vacuumed")
        finally:
            dispatcher.stop()
            thread.join(30)
        assert not thread.is_alive()
        dead, _ = _vacuum_state(conn, schema)
        assert dead < vacuum.ROWS



def test_an_async_dispatcher_vacuums_too_and_its_stop_ends_the_vacuum_thread(
        dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        _dead_rows_in_jobs(conn, schema, vacuum.ROWS + 1000)

        async def main() -> None:
            dispatcher = outbox.AsyncDispatcher(dsn, [ByPayload()], schema=schema)
            running = asyncio.create_task(dispatcher.run())
            try:
                await asyncio.to_thread(wait_until, lambda: _vacuum_state(conn, schema)[1],
                                        what="the jobs table vacuumed")
            finally:
                dispatcher.stop()
                await asyncio.wait_for(running, 30)

        asyncio.run(main())
        assert not [t for t in threading.enumerate() if t.name.startswith("outbox-vacuum")]


# What every dispatcher connection is set to, whatever the server's defaults: SKIP LOCKED
# skips (not serialization failures) only under READ COMMITTED; a dead worker's open
# transaction is ended by the server; a statement whose client has gone is aborted, so a
# worker that dies mid-claim leaves its claim rolled back, not committed and orphaned.
_DISPATCHER_SESSION = {
    "default_transaction_isolation": "read committed",
    "idle_in_transaction_session_timeout": "1min",
    "client_connection_check_interval": "1s",
}


@pytest.mark.parametrize("role", ["claimer", "recorder", "listener"])
def test_every_dispatcher_connection_releases_what_a_dead_worker_holds(
        dsn: str, role: str) -> None:
    settings = Settings.build(dsn, [ByPayload()])
    with connect(settings, role) as conn:
        shown = {name: conn.execute(f"SHOW {name}").fetchone()[0]  # type: ignore[index]
                 for name in _DISPATCHER_SESSION}
    assert shown == _DISPATCHER_SESSION


@pytest.mark.parametrize("role", ["claimer", "recorder"])
def test_every_async_dispatcher_connection_releases_what_a_dead_worker_holds(
        dsn: str, role: str) -> None:
    async def shown() -> dict[str, Any]:
        settings = Settings.build(dsn, [ByPayload()])
        async with await connect_async(settings, role) as conn:
            return {name: (await (await conn.execute(f"SHOW {name}")).fetchone())[0]  # type: ignore[index]
                    for name in _DISPATCHER_SESSION}

    assert asyncio.run(shown()) == _DISPATCHER_SESSION
