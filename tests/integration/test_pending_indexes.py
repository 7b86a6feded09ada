"""Migration 0022 (drop_jobs_claimable): a pending job is written to one index fewer,
the migration runs online behind open business transactions, and the previous
release's statement that walked the dropped index answers as before."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta

import psycopg
import pytest
from psycopg import sql

import outbox
from outbox.migrate import migrations
from outbox.sql import bind_schema, queries

from .helpers import schema_at

DROPPED = next(m.version for m in migrations() if m.name == "drop_jobs_claimable")

# The presence check of the release before the migration (its unhandled_due), which
# walked jobs_claimable from both ends: it still runs, and answers alike, without it.
PREVIOUS_UNHANDLED_DUE = """
WITH due AS (
    (SELECT id, effect, available_at FROM {schema}.jobs
     WHERE status = 'pending' AND available_at <= now()
     ORDER BY available_at, id
     LIMIT %(limit)s)
    UNION
    (SELECT id, effect, available_at FROM {schema}.jobs
     WHERE status = 'pending' AND available_at <= now()
     ORDER BY available_at DESC, id DESC
     LIMIT %(limit)s)
)
SELECT effect, count(*) AS due,
       extract(epoch FROM now() - min(available_at))::float8 AS oldest_age
FROM due
WHERE NOT EXISTS (SELECT 1 FROM {schema}.dispatchers d
                  WHERE d.expires_at > now() AND due.effect = ANY(d.effects))
GROUP BY effect
ORDER BY effect
"""


@pytest.fixture
def before_drop(dsn: str) -> Iterator[str]:
    """A schema migrated up to the version before drop_jobs_claimable."""
    with schema_at(dsn, DROPPED - 1, "pending") as name:
        yield name


def _pending_indexes(conn: psycopg.Connection[tuple[object, ...]], schema: str) -> set[str]:
    """The indexes of jobs a pending job without an ordering key is written to: the
    plain ones and the partial ones whose predicate names 'pending' (jobs_ordering also
    requires an ordering key)."""
    rows = conn.execute(
        "SELECT c.relname, pg_get_expr(i.indpred, i.indrelid) FROM pg_index i "
        "JOIN pg_class c ON c.oid = i.indexrelid JOIN pg_class t ON t.oid = i.indrelid "
        "JOIN pg_namespace n ON n.oid = t.relnamespace "
        "WHERE n.nspname = %s AND t.relname = 'jobs'", (schema,)).fetchall()
    return {str(name) for name, predicate in rows
            if predicate is None or ("'pending'" in str(predicate)
                                     and "ordering_key" not in str(predicate))}


def test_a_pending_job_is_written_to_four_indexes(dsn: str, before_drop: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert _pending_indexes(conn, before_drop) == {
            "jobs_pkey", "jobs_key_unique", "jobs_claimable", "jobs_claimable_effect",
            "jobs_fair"}
        assert outbox.migrate(conn, schema=before_drop, target=DROPPED) == [DROPPED]
        # the two partial indexes left serve every reader (tests/plans)
        assert _pending_indexes(conn, before_drop) == {
            "jobs_pkey", "jobs_key_unique", "jobs_claimable_effect", "jobs_fair"}


def test_the_migration_waits_its_turn_behind_an_open_enqueue(
        dsn: str, before_drop: str, caplog: pytest.LogCaptureFixture) -> None:
    # A business transaction that enqueued holds jobs: the migration's brief lock is not
    # granted, so the run rolls back and tries again, never queueing the business behind
    # it for longer than its lock_timeout; once the business commits, the run applies.
    applied: list[int] = []
    failed: list[BaseException] = []
    with psycopg.connect(dsn) as business:
        with outbox.transaction(business, schema=before_drop) as tx:
            tx.enqueue("test.work", key="open", payload={"n": 1})
            caplog.set_level("WARNING", logger="outbox.migrate")

            def migrate() -> None:
                try:
                    with psycopg.connect(dsn, autocommit=True) as migrating:
                        applied.extend(outbox.migrate(migrating, schema=before_drop, target=DROPPED,
                                                      lock_timeout=0.1))
                except BaseException as exc:  # reported below
                    failed.append(exc)

            runner = threading.Thread(target=migrate)
            runner.start()
            deadline = threading.Event()
            for _ in range(600):  # until a run was refused its lock (at most 60 s)
                if any("not granted" in r.getMessage() for r in caplog.records):
                    break
                deadline.wait(0.1)
            assert any("not granted" in r.getMessage() for r in caplog.records)
            # meanwhile the business goes on writing
            tx.enqueue("test.work", key="open-2", payload={"n": 2})
        runner.join(timeout=120)
    assert not runner.is_alive() and failed == [] and applied == [DROPPED]
    with psycopg.connect(dsn, autocommit=True) as conn:
        keys = conn.execute(sql.SQL("SELECT key FROM {}.jobs ORDER BY id").format(
            sql.Identifier(before_drop))).fetchall()
    assert keys == [("open",), ("open-2",)]


def test_the_previous_releases_presence_check_answers_alike(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        with outbox.transaction(conn, schema=schema) as tx:
            for n in range(5):  # served, due
                tx.enqueue("test.served", key=f"served-{n}", payload={"n": n})
            for n in range(3):  # nobody serves it: due, and one scheduled later
                tx.enqueue("test.typo", key=f"typo-{n}", payload={"n": n})
            tx.enqueue("test.typo", key="typo-later", payload={},
                       run_at=timedelta(hours=1))
            tx.enqueue("test.later", key="later", payload={}, run_at=timedelta(hours=1))
        conn.execute(sql.SQL("UPDATE {}.jobs SET available_at = available_at - "
                             "interval '1 minute' WHERE key = 'typo-0'").format(
            sql.Identifier(schema)))
        conn.execute(sql.SQL("INSERT INTO {}.dispatchers (worker_id, effects, expires_at) "
                             "VALUES ('w', ARRAY['test.served'], now() + interval '1 hour')"
                             ).format(sql.Identifier(schema)))
        previous = conn.execute(bind_schema(PREVIOUS_UNHANDLED_DUE, schema).encode(),
                                {"limit": 100}).fetchall()
        now = conn.execute(queries(schema).unhandled_due, {"limit": 100}).fetchall()
    assert [(effect, due) for effect, due, _ in now] == [("test.typo", 3)]
    assert [(effect, due) for effect, due, _ in previous] == [("test.typo", 3)]
    assert now[0][2] == pytest.approx(previous[0][2], abs=5.0)
    assert now[0][2] >= 60.0  # the oldest: typo-0, due a minute early
