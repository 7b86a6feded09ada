"""What the fan-in tests share: a child effect that records what it saw, and readers."""

from __future__ import annotations

import threading
from typing import Any

import psycopg

import outbox
from outbox.testing import jobs, ledger
from outbox.testing import ledger_row as _ledger_row

NOTIFIED = "order.notified"


class MarkNotified(outbox.Effect):
    """The child: records, per perform, the job's parents' results, and whether every
    parent's ledger row was committed when it ran (read on a connection of its own)."""

    name = NOTIFIED

    def __init__(self, dsn: str, schema: str) -> None:
        self.dsn, self.schema = dsn, schema
        self.lock = threading.Lock()
        self.seen: list[tuple[str, dict[str, Any], set[str]]] = []

    def perform(self, job: outbox.Job) -> dict[str, Any]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            recorded = set(ledger(conn, self.schema))
        with self.lock:
            self.seen.append((job.key, dict(job.after_results), recorded))
        return {"notified": job.key}

    def performs(self, key: str) -> list[tuple[dict[str, Any], set[str]]]:
        with self.lock:
            return [(results, recorded) for k, results, recorded in self.seen if k == key]


def job_row(dsn: str, schema: str, key: str) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return jobs(conn, schema)[key]


def ledger_row(dsn: str, schema: str, key: str) -> dict[str, Any] | None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return _ledger_row(conn, key, schema)
