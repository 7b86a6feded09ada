"""Sampling, every ~100 ms, how long any job has stayed ``running`` past its lease."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import psycopg

from ._sql import ChaosQueries
from .database import connect

__all__ = ["LeaseMonitor"]


@dataclass
class LeaseMonitor:
    """``max_overrun`` is the largest ``now() - lease_until`` seen over running jobs
    (seconds; 0 when no lease was ever seen expired), ``worst_key`` that job's key.
    Samples are lost while the database is down (a restart): ``failed`` counts them."""

    dsn: str
    queries: ChaosQueries
    interval: float = 0.1
    max_overrun: float = 0.0
    worst_key: str | None = None
    samples: int = 0
    failed: int = 0

    def run(self, stop: threading.Event) -> None:
        """Sample until ``stop`` is set."""
        conn: psycopg.Connection[Any] | None = None
        try:
            while not stop.wait(self.interval):
                conn = self._sample(conn)
        finally:
            if conn is not None:
                conn.close()

    def _sample(self, conn: psycopg.Connection[Any] | None) -> psycopg.Connection[Any] | None:
        try:
            if conn is None or conn.closed:
                conn = connect(self.dsn, "chaos monitor")
            row = conn.execute(self.queries.lease_overrun, {}).fetchone()
        except psycopg.OperationalError:
            self.failed += 1
            if conn is not None:
                conn.close()
            return None
        self.samples += 1
        if row is not None and float(row[0]) > self.max_overrun:
            self.max_overrun = float(row[0])
            self.worst_key = str(row[1])
        return conn
