"""What the bad-input tests share: a trivial effect, enqueue and read-back helpers."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql

import outbox
from outbox import Effect, Job

__all__ = ["Scripted", "enqueue", "job_rows", "keys", "ledger_rows"]


class Scripted(Effect):
    """``test.bad``: runs ``behaviour(job)`` and counts calls per key."""

    name = "test.bad"

    def __init__(self, behaviour: Callable[[Job], Any]) -> None:
        self._behaviour = behaviour
        self._lock = threading.Lock()
        self.calls: Counter[str] = Counter()

    def perform(self, job: Job) -> Any:
        with self._lock:
            self.calls[job.key] += 1
        return self._behaviour(job)


def enqueue(dsn: str, schema: str, key: str, payload: dict[str, Any], **options: Any) -> int:
    """Enqueue one ``test.bad`` job (committed) and return its id."""
    effect = options.pop("effect", "test.bad")
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        result = tx.enqueue(effect, key=key, payload=payload, **options)
    assert result.created and result.job_id is not None
    return result.job_id


def _rows(dsn: str, schema: str, table: str) -> list[dict[str, Any]]:
    query = sql.SQL("SELECT * FROM {}.{}").format(sql.Identifier(schema), sql.Identifier(table))
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(query)
        names = [d.name for d in cur.description or []]
        return [dict(zip(names, row, strict=True)) for row in cur]


def job_rows(dsn: str, schema: str) -> dict[str, dict[str, Any]]:
    """Every job by key."""
    return {row["key"]: row for row in _rows(dsn, schema, "jobs")}


def ledger_rows(dsn: str, schema: str) -> dict[str, dict[str, Any]]:
    """Every ledger row by key."""
    return {row["key"]: row for row in _rows(dsn, schema, "effect_results")}


def keys(dsn: str, schema: str) -> set[str]:
    """The keys of every job and every ledger row: what enqueue has written."""
    return set(job_rows(dsn, schema)) | set(ledger_rows(dsn, schema))
