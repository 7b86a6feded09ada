"""Helpers of the many-databases tests: databases made for a test, enqueueing into a
target, reading its jobs' statuses, an effect that counts what it performs."""

from __future__ import annotations

import threading
import uuid
from collections import Counter

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

import outbox
from outbox import Effect, Job, NewJob, Target


class Recorded(Effect):
    """Counts each (target, key) it performs; keys are unique per target."""

    name = "test.recorded"

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.performed: Counter[str] = Counter()

    def perform(self, job: Job) -> None:
        with self.lock:
            self.performed[job.key] += 1


class Databases:
    """Databases made for one test, dropped after it."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.names: list[str] = []

    def make(self, *schemas_in: str) -> str:
        name = f"fleet_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(self.dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        self.names.append(name)
        dsn = make_conninfo(self.dsn, dbname=name)
        with psycopg.connect(dsn, autocommit=True) as conn:
            for schema in schemas_in:
                outbox.migrate(conn, schema=schema)
        return dsn

    def drop(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as admin:
            for name in self.names:
                admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                    sql.Identifier(name)))


def enqueue(target: Target, count: int, first: int = 0) -> None:
    prefix = target.name
    with psycopg.connect(target.dsn) as conn, outbox.transaction(conn, schema=target.schema) as tx:
        tx.enqueue_many([NewJob(Recorded.name, f"{prefix}/{i}", {})
                         for i in range(first, first + count)])


def statuses(target: Target) -> Counter[str]:
    with psycopg.connect(target.dsn, autocommit=True) as conn:
        rows = conn.execute(sql.SQL("SELECT status, count(*) FROM {}.jobs GROUP BY 1").format(
            sql.Identifier(target.schema))).fetchall()
    return Counter({status: n for status, n in rows})


class Started:
    """Counts the dispatcher's threads started and connections opened (by name)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.threads = 0
        self.connections = 0
