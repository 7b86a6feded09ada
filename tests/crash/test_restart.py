"""Connections drop under a running dispatcher: a PostgreSQL restart, killed backends.

The dispatcher must reconnect and finish: every job ends done, none is lost, the provider
acts once per key, and no delivery happens without a claim behind it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

import outbox
from outbox.testing import Server, jobs, ledger, start_server

from .provider import Conn, Provider, create_tables
from .support import (
    Workers,
    connect,
    count_done,
    dispatcher_backends,
    enqueue,
    session,
    table,
    wait_until,
)

WAVE = 200
SLOW = {"sleep": 0.02}  # 200 jobs at concurrency 4 take about a second: still flowing


@pytest.fixture
def own_server() -> Iterator[Server]:
    """An embedded PostgreSQL of this test's own, to restart without disturbing others."""
    with start_server() as server:
        yield server


def _assert_each_done_once(db: Conn, schema: str, keys: list[str]) -> None:
    provider = Provider(db, schema)
    by_key = jobs(db, schema)
    assert sorted(by_key) == sorted(keys)
    assert {j["status"] for j in by_key.values()} == {"done"}
    assert sorted(ledger(db, schema)) == sorted(keys)
    assert sorted(provider.acted()) == sorted(keys)
    performed = provider.performed()
    # Redelivery is allowed (a reply lost in the restart), but never without a claim.
    assert all(1 <= performed[k] <= by_key[k]["attempts"] for k in keys)


def test_postgresql_restart_mid_run_loses_nothing(own_server: Server, tmp_path: Path) -> None:
    uri = own_server.dsn
    schema = "outbox"
    first = [f"a-{i}" for i in range(WAVE)]
    second = [f"b-{i}" for i in range(WAVE)]
    workers = Workers(uri, schema, tmp_path)
    try:
        with connect(uri) as db:
            outbox.migrate(db, schema=schema)
            create_tables(db, schema)
            worker = workers.start("run", lease=2.0, concurrency=4)
            enqueue(db, schema, first, SLOW)
            wait_until(lambda: count_done(db, schema) >= WAVE // 5, "jobs to flow")
        own_server.restart()  # drops every connection, ours included
        with connect(uri) as db:
            assert count_done(db, schema) < WAVE, "the restart came while jobs were flowing"
            enqueue(db, schema, second, SLOW)
            wait_until(lambda: count_done(db, schema) == 2 * WAVE, "every job done", timeout=60)
            stats = worker.stop()
            assert stats["reconnects"] >= 1
            _assert_each_done_once(db, schema, first + second)
    finally:
        workers.cleanup()


def _terminate_dispatcher_backends(db: Conn, schema: str) -> int:
    pids = dispatcher_backends(db, schema)
    rows = db.execute("SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS pid",
                      (pids,)).fetchall()
    return sum(1 for (terminated,) in rows if terminated)


def test_killed_dispatcher_connections_reconnect_and_finish(
    schema: str, db: Conn, provider: Provider, workers: Workers,
) -> None:
    first = [f"a-{i}" for i in range(WAVE)]
    second = [f"b-{i}" for i in range(WAVE)]
    worker = workers.start("run", lease=2.0, concurrency=4)
    enqueue(db, schema, first, SLOW)
    wait_until(lambda: count_done(db, schema) >= WAVE // 5, "jobs to flow")
    assert _terminate_dispatcher_backends(db, schema) == 3
    assert count_done(db, schema) < WAVE, "the connections died while jobs were flowing"
    enqueue(db, schema, second, SLOW)
    wait_until(lambda: count_done(db, schema) >= WAVE + WAVE // 5, "jobs to flow again")
    assert _terminate_dispatcher_backends(db, schema) >= 2
    wait_until(lambda: count_done(db, schema) == 2 * WAVE, "every job done", timeout=60)
    stats = worker.stop()
    assert stats["reconnects"] >= 2
    _assert_each_done_once(db, schema, first + second)


def test_a_statement_error_is_not_mistaken_for_a_lost_connection(
    dsn: str, schema: str, db: Conn, provider: Provider, workers: Workers,
) -> None:
    """A lock timeout (55P03), like a serialization failure (40001) or a deadlock (40P01),
    is a psycopg OperationalError, the class of a dropped connection too; but the
    connection is fine. It is a failed statement to log and retry, not a reconnect."""
    worker = workers.start("run", dsn=make_conninfo(dsn, options="-c lock_timeout=100"),
                           poll_interval=0.05)
    with session(dsn) as locker:
        locker.execute(sql.SQL("LOCK TABLE {} IN SHARE MODE").format(table(schema, "jobs")))
        wait_until(lambda: "55P03" in worker.log() or "LockNotAvailable" in worker.log(),
                   "the dispatcher's statement to time out on the lock")
    enqueue(db, schema, ["k"])
    wait_until(lambda: count_done(db, schema) == 1, "the job done once the lock is gone")
    stats = worker.stop()
    assert "lost its connection" not in worker.log(), worker.log()[-1500:]
    assert stats["reconnects"] == 0
