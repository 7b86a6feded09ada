"""Vacuum between autovacuum's visits: the queue tables' dead rows reclaimed as they pile up.

Every job leaves dead row versions behind it (its claim, its done, its retention), and
autovacuum visits a table at most once per ``autovacuum_naptime`` (a minute by default)
however low the table's thresholds (set by the migrations). At 4,000 jobs a second that is
half a million dead rows between two visits: the jobs table has to hold them all, about
three times its live rows, and took five minutes of such cycles to stop growing under a
steady load (the soak benchmark). So a dispatcher looks every ``CHECK_INTERVAL`` seconds
(one read of ``pg_stat_user_tables``) and, for a queue table with at least ``ROWS`` dead
rows and ``SHARE`` of its live ones, not vacuumed (by anyone) in the last ``GAP`` seconds,
runs ``VACUUM`` on a thread and a connection of its own, so no claim waits for it.

``SKIP_LOCKED``: a table another session vacuums (another dispatcher, autovacuum) or
alters is left for this time, never waited for. ``TRUNCATE false``: giving the table's
empty tail back to the system needs an exclusive lock, which enqueues and claims would
queue behind; autovacuum still does it. A role that may not vacuum a table (not its owner
nor a superuser) leaves it to autovacuum. A stop cancels a vacuum in progress. Only
``run()`` vacuums: ``run_until_idle`` (a cron job, a fleet's turn) ends before it would
pay off.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg

from .._sql import bind_schema
from .._steps import Statement, Step
from .connection import connect
from .settings import Settings
from .signals import Timer
from .statistics import TABLES

__all__ = ["CHECK_INTERVAL", "GAP", "ROWS", "SHARE", "QueueVacuum"]

log = logging.getLogger("outbox.dispatcher")

CHECK_INTERVAL = 5.0
ROWS = 10_000
SHARE = 0.2
GAP = 10.0
CLOSE_WAIT = 5.0  # seconds a stop waits for a cancelled vacuum to end


@dataclass
class QueueVacuum:
    """Vacuums the queue tables that autovacuum has not reached yet (one part: the
    claimer decides, a thread of its own runs the ``VACUUM``)."""

    settings: Settings
    enabled: bool = True
    timer: Timer = field(default_factory=lambda: Timer(CHECK_INTERVAL))
    refused: set[str] = field(default_factory=set)  # tables this role may not vacuum
    _thread: threading.Thread | None = None
    _conn: psycopg.Connection[Any] | None = None  # the running vacuum's, for a stop
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _closed: bool = False

    def due(self, now: float) -> bool:
        return self.enabled and self.timer.due(now) and not self.running

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def check(self) -> Step[None]:
        """Read which queue tables are due (``vacuum_due``) and start their vacuum."""
        rows = yield Statement(self.settings.queries.vacuum_due, {
            "schema_name": self.settings.schema, "tables": list(TABLES), "rows": ROWS,
            "share": SHARE, "gap": GAP,
        }, named=True)
        tables = [row.name for row in rows if row.name in TABLES and row.name not in self.refused]
        if tables:
            self.start(tables)

    def start(self, tables: Sequence[str]) -> None:
        """Vacuum ``tables`` on a thread (nothing when one still runs or after close)."""
        with self._lock:
            if self._closed or self.running:
                return
            self._thread = threading.Thread(
                target=self._vacuum, args=(list(tables),), daemon=True,
                name=f"outbox-vacuum-{self.settings.schema}")
            self._thread.start()

    def _vacuum(self, tables: list[str]) -> None:
        schema = self.settings.schema
        try:
            conn = connect(self.settings, "vacuum")
        except psycopg.Error as exc:  # the claimer reports the database's troubles
            log.debug("vacuum: no connection (%s)", type(exc).__name__)
            return
        with self._lock:
            if self._closed:
                conn.close()
                return
            self._conn = conn
        try:
            for table in tables:
                statement = bind_schema(
                    "VACUUM (SKIP_LOCKED, TRUNCATE false) {schema}." + table, schema)
                try:
                    conn.execute(statement)
                except psycopg.errors.InsufficientPrivilege:
                    self.refused.add(table)
                    log.info("the dispatcher's role may not VACUUM %s.%s: autovacuum "
                             "alone keeps it", schema, table)
                except psycopg.errors.QueryCanceled:
                    if not self._closed:  # the role's statement_timeout, not a stop:
                        self.refused.add(table)  # it would cut every vacuum short
                        log.info("vacuum of %s.%s was cancelled (the role's "
                                 "statement_timeout?): autovacuum alone keeps it",
                                 schema, table)
                    return
                except psycopg.Error as exc:
                    log.warning("vacuum of %s.%s failed: %s", schema, table,
                                exc.sqlstate or type(exc).__name__)
                    return
        finally:
            with self._lock:
                self._conn = None
            conn.close()

    def close(self) -> None:
        """Stop: no new vacuum; the running one is cancelled and waited for (at most
        ``CLOSE_WAIT`` seconds, so a stop always ends)."""
        with self._lock:
            self._closed = True
            conn, thread = self._conn, self._thread
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                conn.cancel_safe(timeout=CLOSE_WAIT)
        # Only a vacuum under way is waited for: a thread still connecting (to a server
        # that may not answer) sees the close itself and drops its connection.
        if thread is not None and conn is not None:
            thread.join(CLOSE_WAIT)
