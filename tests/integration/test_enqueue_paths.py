"""The enqueue paths trimmed for cost store exactly what they stored before: a batch
whose jobs leave fields at their defaults (left out of the statement's JSON) stores the
same row as ``enqueue`` with the same arguments, and the untraced single enqueue answers
a new key, a repeat and a conflict as the traced path does."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

import outbox
from outbox import IdempotencyKeyConflict, NewJob

AT = datetime(2031, 5, 17, 9, 30, tzinfo=UTC)
# (run_at, ordering_key, max_attempts, group, priority): each optional field set alone,
# none, and all of them
OPTIONS: list[dict[str, Any]] = [
    {}, {"run_at": AT}, {"ordering_key": "line-1"}, {"max_attempts": 3}, {"group": "tenant-7"},
    {"priority": -5}, {"priority": 1000},
    {"run_at": AT, "ordering_key": "line-2", "max_attempts": 9, "group": "t", "priority": 7},
]
COLUMNS = ("effect", "payload", "fingerprint", "status", "available_at", "ordering_key",
           "max_attempts", "group_key", "priority", "trace_context", "after_failed")


def _rows(conn: psycopg.Connection[Any], schema: str, prefix: str) -> list[tuple[Any, ...]]:
    return conn.execute(sql.SQL("SELECT {} FROM {}.jobs WHERE key LIKE %s ORDER BY id").format(
        sql.SQL(", ").join(map(sql.Identifier, COLUMNS)), sql.Identifier(schema)),
        (prefix + "%",)).fetchall()


def test_a_batch_stores_each_job_as_enqueue_does(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn) as conn:
        with outbox.transaction(conn, schema=schema) as tx:  # one transaction: one now()
            for n, options in enumerate(OPTIONS):
                tx.enqueue("test.paths", key=f"one-{n}", payload={"n": n, "x": [1.5, None]},
                           **options)
            results = tx.enqueue_many([
                NewJob("test.paths", key=f"many-{n}", payload={"n": n, "x": [1.5, None]},
                       **options) for n, options in enumerate(OPTIONS)])
        one, many = _rows(conn, schema, "one-"), _rows(conn, schema, "many-")
    assert len(one) == len(OPTIONS) and many == one
    assert all(r.created for r in results)
    ids = [r.job_id or 0 for r in results]
    assert 0 not in ids and ids == sorted(ids)  # created in the batch's order
    # the defaults are the column's values, not NULLs
    assert [row[COLUMNS.index("priority")] for row in many] == [
        o.get("priority", 0) for o in OPTIONS]
    assert [row[COLUMNS.index("max_attempts")] for row in many] == [
        o.get("max_attempts", 25) for o in OPTIONS]


def test_the_untraced_enqueue_answers_new_repeat_and_conflict(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn) as conn:
        with outbox.transaction(conn, schema=schema) as tx:
            first = tx.enqueue("test.paths", key="k", payload={"a": 1})
            again = tx.enqueue("test.paths", key="k", payload={"a": 1})
            assert first.created and first.job_id is not None
            assert (again.created, again.job_id) == (False, first.job_id)
            with pytest.raises(IdempotencyKeyConflict, match="different payload"):
                tx.enqueue("test.paths", key="k", payload={"a": 2})
            with pytest.raises(IdempotencyKeyConflict, match="for effect 'test.paths'"):
                tx.enqueue("test.other", key="k", payload={"a": 1})
        later = datetime.now(UTC) + timedelta(hours=1)
        with outbox.transaction(conn, schema=schema) as tx:
            scheduled = tx.enqueue("test.paths", key="k2", payload={}, run_at=later)
        [(available_at,)] = conn.execute(sql.SQL("SELECT available_at FROM {}.jobs WHERE id = %s")
                                         .format(sql.Identifier(schema)),
                                         (scheduled.job_id,)).fetchall()
    assert available_at == later
