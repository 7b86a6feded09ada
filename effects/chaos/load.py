"""Enqueuing the planned jobs: business transactions from several threads, through
restarts and dropped connections.

Each batch is one business transaction: a row in ``orders`` plus its jobs via
``outbox.transaction(...).enqueue_many``. A transaction cut off by a connection loss is
retried with the same keys until it is known to have committed: enqueue is idempotent
per key and the order row is inserted ``ON CONFLICT DO NOTHING``, so a retry after a
commit whose answer was lost adds nothing. Rollback batches raise inside the block.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg

import outbox
from outbox import NewJob

from ._sql import ChaosQueries
from .database import connect
from .schedule import Batch

__all__ = ["Enqueuer"]


class _RolledBack(Exception):
    """Raised inside a rollback batch's transaction to roll it back."""


@dataclass
class Enqueuer:
    """Commits batches until ``deadline`` (a ``time.monotonic()`` value), each into the
    outbox schema of its target (``schemas[batch.target]``).

    ``committed`` and ``rolled_back`` name the batches that ended each way; ``retries``
    counts transactions repeated after a connection loss; ``errors`` anything else.
    """

    dsn: str
    schemas: Sequence[str]
    queries: ChaosQueries
    deadline: float
    committed: set[str] = field(default_factory=set)
    rolled_back: set[str] = field(default_factory=set)
    retries: int = 0
    errors: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def run_threads(self, groups: Sequence[Sequence[Batch]], stop: threading.Event,
                    started: float) -> list[threading.Thread]:
        """Start one thread per group of batches, each batch at ``started + batch.at``."""
        threads = [threading.Thread(target=self.run, args=(group, stop, started),
                                    name=f"chaos-enqueue-{n}", daemon=True)
                   for n, group in enumerate(groups)]
        for thread in threads:
            thread.start()
        return threads

    def run(self, batches: Sequence[Batch], stop: threading.Event, started: float) -> None:
        """Commit ``batches`` in order, each not before its time, on one connection."""
        conn: psycopg.Connection[Any] | None = None
        rng = random.Random(len(batches))  # only for retry jitter
        try:
            for batch in batches:
                if stop.wait(max(0.0, started + batch.at - time.monotonic())):
                    return
                conn = self._commit(conn, batch, rng)
        except Exception as exc:  # reported, never lost in a thread
            with self._lock:
                self.errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            if conn is not None:
                conn.close()

    def _commit(self, conn: psycopg.Connection[Any] | None, batch: Batch,
                rng: random.Random) -> psycopg.Connection[Any] | None:
        for attempt in range(1000):  # bounded in count and by the deadline
            try:
                if conn is None or conn.closed:
                    conn = connect(self.dsn, "chaos enqueue")
                    conn.autocommit = False
                self._transaction(conn, batch)
                return conn
            except psycopg.OperationalError:
                if conn is not None:
                    conn.close()
                conn = None
                with self._lock:
                    self.retries += 1
                if time.monotonic() > self.deadline:
                    raise
                time.sleep(rng.uniform(0.05, min(1.0, 0.05 * 2 ** min(attempt, 5))))
        raise RuntimeError(f"batch {batch.name} did not commit in 1000 attempts")

    def _transaction(self, conn: psycopg.Connection[Any], batch: Batch) -> None:
        try:
            with outbox.transaction(conn, schema=self.schemas[batch.target]) as tx:
                conn.execute(self.queries.insert_order,
                             {"batch": batch.name, "jobs": len(batch.jobs)})
                tx.enqueue_many(NewJob(j.effect, j.key, j.payload, group=j.group,
                                   priority=j.priority) for j in batch.jobs)
                if batch.rollback:
                    raise _RolledBack(batch.name)
        except _RolledBack:
            with self._lock:
                self.rolled_back.add(batch.name)
            return
        with self._lock:
            self.committed.add(batch.name)
