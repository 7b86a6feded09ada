"""Several dispatcher processes draining one queue: each job claimed and performed once.

Also under a database whose default isolation is REPEATABLE READ, where SKIP LOCKED raises
serialization failures (40001) instead of skipping unless the dispatcher sets READ
COMMITTED itself.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

import outbox
from outbox.sql import queries
from outbox.testing import jobs, ledger

from .provider import EFFECT, Conn, Provider, create_tables
from .support import (
    Stats,
    Workers,
    connect,
    count_done,
    dispatcher_backends,
    enqueue,
    session,
    wait_until,
    waiting_on_lock,
)


def _drain_with(db: Conn, workers: Workers, dsn: str, schema: str, processes: int,
                count: int) -> list[Stats]:
    """Start ``processes`` dispatchers, wait until all listen, enqueue ``count`` jobs in
    one transaction, wait until every job is done; return each process's stats."""
    started = [workers.start("run", dsn=dsn, schema=schema, lease=5.0, concurrency=4,
                             poll_interval=0.1) for _ in range(processes)]
    wait_until(lambda: len(dispatcher_backends(db, schema, "listener")) == processes,
               f"{processes} dispatchers to listen")
    enqueue(db, schema, [f"job-{i:05d}" for i in range(count)])
    wait_until(lambda: count_done(db, schema) == count, f"{count} jobs done", timeout=90)
    stats = [worker.stop() for worker in started]
    for worker, counters in zip(started, stats, strict=True):
        _assert_no_serialization_failure(worker.log(), counters)
    return stats


def _assert_no_serialization_failure(log: str, stats: Stats) -> None:
    # psycopg's SerializationFailure (40001) is an OperationalError, which the dispatcher
    # handles as a lost connection: look for the name, the code and a reconnect alike.
    for sign in ("SerializationFailure", "could not serialize", " ERROR "):
        assert sign not in log, log[-2000:]
    assert not re.search(r"(?<![\d.])40001(?!\d)", log), log[-2000:]
    assert stats["reconnects"] == 0


def _assert_each_performed_once(db: Conn, schema: str, stats: list[Stats],
                                count: int) -> None:
    assert all(s["claimed"] > 0 for s in stats), f"some process took no part: {stats}"
    assert sum(s["claimed"] for s in stats) == sum(s["done"] for s in stats) == count
    assert sum(s["stale_completions"] + s["rescued"] + s["retried"] for s in stats) == 0
    by_key = jobs(db, schema)
    assert len(by_key) == count
    assert {(j["status"], j["attempts"], j["claim_version"]) for j in by_key.values()} == {
        ("done", 1, 1)}
    provider = Provider(db, schema)
    performed = provider.performed()
    assert len(performed) == count and set(performed.values()) == {1}, "performed twice"
    assert sorted(ledger(db, schema)) == sorted(by_key)


def test_four_dispatcher_processes_perform_each_of_4000_jobs_once(
    dsn: str, schema: str, db: Conn, provider: Provider, workers: Workers,
) -> None:
    stats = _drain_with(db, workers, dsn, schema, processes=4, count=4000)
    _assert_each_performed_once(db, schema, stats, 4000)


@pytest.fixture
def repeatable_read_dsn(dsn: str) -> Iterator[str]:
    """A database of its own whose default isolation is REPEATABLE READ, migrated."""
    name = f"crash_rr_{uuid.uuid4().hex[:8]}"
    with connect(dsn) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        admin.execute(sql.SQL("ALTER DATABASE {} SET default_transaction_isolation"
                              " = 'repeatable read'").format(sql.Identifier(name)))
    rr_dsn = make_conninfo(dsn, dbname=name)
    try:
        with connect(rr_dsn) as conn:
            outbox.migrate(conn, schema="outbox")
            create_tables(conn, "outbox")
        yield rr_dsn
    finally:
        with connect(dsn) as admin:
            admin.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


def test_repeatable_read_default_turns_skip_locked_into_40001(repeatable_read_dsn: str) -> None:
    """The control: in this database, a claim that does not set READ COMMITTED fails."""
    with connect(repeatable_read_dsn) as db, session(repeatable_read_dsn) as late:
        enqueue(db, "outbox", ["k"])
        # ``late`` takes its snapshot now, at the database's default isolation...
        isolation = late.execute("SELECT current_setting('transaction_isolation')").fetchone()
        assert isolation == ("repeatable read",)
        # ...another worker claims the job and commits...
        params = {"effects": [EFFECT], "limit": 10, "lease": 30.0, "worker": "w", "after": "{}"}
        assert len(db.execute(queries("outbox").claim, params).fetchall()) == 1
        # ...and ``late``'s claim, still seeing the job pending, cannot skip it: 40001.
        with pytest.raises(psycopg.errors.SerializationFailure):
            late.execute(queries("outbox").claim, params)


def test_dispatchers_drain_a_repeatable_read_database_without_serialization_failures(
    repeatable_read_dsn: str, workers: Workers,
) -> None:
    with connect(repeatable_read_dsn) as db:
        stats = _drain_with(db, workers, repeatable_read_dsn, "outbox", processes=3, count=2000)
        _assert_each_performed_once(db, "outbox", stats, 2000)


def _claimer_waiting(db: Conn) -> bool:
    return any(waiting_on_lock(db, pid) for pid in dispatcher_backends(db, "outbox", "claimer"))


def test_dispatcher_claims_a_row_changed_after_its_snapshot_in_a_repeatable_read_database(
    repeatable_read_dsn: str, workers: Workers,
) -> None:
    """The interleaving that turns SKIP LOCKED into 40001 at REPEATABLE READ, forced on the
    dispatcher's own claim: it takes its snapshot, waits on a table lock, and meanwhile the
    job it will visit is updated and committed. At READ COMMITTED it claims the job."""
    jobs_table = sql.SQL("outbox.jobs")
    with connect(repeatable_read_dsn) as db, session(repeatable_read_dsn) as holder, \
            session(repeatable_read_dsn) as locker:
        enqueue(db, "outbox", ["k", "warm-up"])
        holder.execute(sql.SQL("SELECT 1 FROM {} WHERE key = 'k' FOR UPDATE").format(jobs_table))
        worker = workers.start("run", dsn=repeatable_read_dsn, schema="outbox",
                               rescue_interval=1000.0, poll_interval=0.05)
        wait_until(lambda: jobs(db, "outbox")["warm-up"]["status"] == "done",
                   "the dispatcher's first rounds (k is locked, so skipped)")
        locker.execute(sql.SQL("LOCK TABLE {} IN SHARE MODE").format(jobs_table))
        wait_until(lambda: _claimer_waiting(db), "the next claim to wait, its snapshot taken")
        holder.rollback()
        locker.execute(sql.SQL("UPDATE {} SET updated_at = now() WHERE key = 'k'").format(
            jobs_table))
        locker.commit()
        wait_until(lambda: jobs(db, "outbox")["k"]["status"] == "done", "k done")
        stats = worker.stop()
    assert (stats["claimed"], stats["done"]) == (2, 2)
    _assert_no_serialization_failure(worker.log(), stats)
