"""Where a chaos run keeps its data: a database of its own, dropped at the end.

Without a DSN the runner starts an embedded PostgreSQL in its work directory and owns
it (so it may restart it). With a DSN it never touches other data: it creates a database
of its own (``outbox_chaos_<id>``) and drops it afterwards; if it may not create
databases, it falls back to two schemas of its own in the DSN's database, dropped
afterwards. It never restarts a server it does not own.

A run with several targets (``ChaosConfig.targets``) migrates one outbox schema per
target (``outbox``, ``outbox_t2``, ``outbox_t3``, ...) and restarts each one's job ids
at a distinct multiple of ``TARGET_ID_SPAN``. Its checks read every target at once
through a schema of views (``outbox_all``): ``jobs`` and ``effect_results``, each the
``UNION ALL`` of the targets' tables with a ``target`` column (the schema's name). A run
with one target has the same views over its one schema, so the runner reads the same
way whatever the count; only the statements that lock rows or tables (which a view of a
``UNION ALL`` cannot serve) are run against each target's own schema.

A run with the ``failover`` fault (and no ``--dsn``) owns a pair instead
(``effects.chaos.standby``): a primary and its asynchronous streaming standby on TCP,
reached by a multi-host DSN with ``target_session_attrs=read-write``, as an HA client
connects; every connection of the run (workers, enqueuers, consumers, checks) uses it.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

import outbox
from outbox.testing import Server, start_server

from ._sql import chaos_queries
from .standby import PairServer

__all__ = ["TARGET_ID_SPAN", "Database", "connect", "provision", "release"]

# Target n (from 0) numbers its jobs from n * TARGET_ID_SPAN + 1: ids stay unique over
# the union of the targets, so the checks can compare a ledger row's job id with its job.
TARGET_ID_SPAN = 10**12

log = logging.getLogger("effects.chaos")


def connect(dsn: str, name: str = "chaos runner") -> psycopg.Connection[Any]:
    """An autocommit connection of the runner (never named "outbox ...": the runner's
    own connections are not targets of the terminate fault)."""
    return psycopg.connect(dsn, autocommit=True, connect_timeout=5, application_name=name)


@dataclass
class Database:
    """The run's database. ``dsn`` reaches it; ``targets`` are the outbox schemas (the
    first is ``schema``, which also holds the inbox of the event consumers), ``view``
    the schema of views over all of them, ``chaos`` the audit and business rows.
    ``server`` is the embedded server when the run owns one; ``own_database`` the
    database created for the run, if any."""

    admin_dsn: str
    dsn: str
    schema: str
    chaos: str
    own_database: str | None
    server: Server | PairServer | None
    targets: tuple[str, ...]
    view: str

    @property
    def restartable(self) -> bool:
        """Whether the run owns the server and so may restart it."""
        return self.server is not None

    @property
    def mode(self) -> str:
        """How the run is isolated, for the report."""
        where = "embedded PostgreSQL" if self.server is not None else "--dsn server"
        if isinstance(self.server, PairServer):
            where = "embedded PostgreSQL primary and streaming standby (multi-host DSN)"
        what = f"database {self.own_database}" if self.own_database else \
            f"schemas {', '.join(self.targets)}, {self.chaos}"
        if len(self.targets) > 1:
            what += f", {len(self.targets)} targets ({', '.join(self.targets)})"
        return f"{where}, {what}"

    def restart(self) -> float:
        """Restart the owned server (every connection drops); return the seconds taken."""
        if self.server is None:
            raise RuntimeError("the run does not own this PostgreSQL server")
        started = time.monotonic()
        self.server.restart()
        return time.monotonic() - started

    @property
    def can_fail_over(self) -> bool:
        """Whether the run owns a primary with a standby to promote (not yet promoted)."""
        return isinstance(self.server, PairServer) and self.server.failed_over is None

    def fail_over(self, lag: float = 0.0) -> float:
        """Kill the primary for good and promote its standby, its WAL receipt stalled
        ``lag`` seconds before; return the seconds the kill and promotion took."""
        if not isinstance(self.server, PairServer):
            raise RuntimeError("the run owns no standby to promote")
        return self.server.failover(lag)


def provision(dsn: str | None, work_dir: Path, targets: int = 1,
              standby: bool = False) -> Database:
    """Start or reach the server, create the run's own database (or schemas), migrate
    ``targets`` outbox schemas and create the views over them. ``standby`` (without
    ``dsn``): a primary and a streaming standby of it instead of one embedded server."""
    server: Server | PairServer | None = None
    if dsn is None:
        server = PairServer() if standby else start_server(work_dir / "data")
        dsn = server.dsn
    run_id = uuid.uuid4().hex[:10]
    try:
        database = _own_database(dsn, f"outbox_chaos_{run_id}", server, targets)
    except psycopg.errors.InsufficientPrivilege:
        log.warning("may not create a database here: using schemas of the run's own")
        base = f"outbox_chaos_{run_id}"
        database = Database(dsn, dsn, base, f"chaos_audit_{run_id}", None, server,
                            _target_schemas(base, targets), f"{base}_all")
    try:
        _create_tables(database)
    except BaseException:
        release(database)
        raise
    return database


def _own_database(admin_dsn: str, name: str, server: Server | PairServer | None,
                  targets: int) -> Database:
    with connect(admin_dsn) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return Database(admin_dsn, make_conninfo(admin_dsn, dbname=name), "outbox", "chaos",
                    name, server, _target_schemas("outbox", targets), "outbox_all")


def _target_schemas(first: str, targets: int) -> tuple[str, ...]:
    """``first``, then ``first_t2``, ``first_t3``, ...: one outbox schema per target."""
    return (first, *(f"{first}_t{n}" for n in range(2, targets + 1)))


def _create_tables(database: Database) -> None:
    with connect(database.dsn) as conn:
        for n, schema in enumerate(database.targets):
            outbox.migrate(conn, schema=schema)
            if n:
                conn.execute(sql.SQL("ALTER TABLE {}.jobs ALTER COLUMN id RESTART WITH {}")
                             .format(sql.Identifier(schema),
                                     sql.Literal(n * TARGET_ID_SPAN + 1)))
        _create_views(conn, database)
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(database.chaos)))
        queries = chaos_queries(database.schema, database.chaos)
        conn.execute(queries.create_tables)
        conn.execute(queries.create_consumed)


def _create_views(conn: psycopg.Connection[Any], database: Database) -> None:
    """The view schema: ``jobs`` and ``effect_results`` of every target, each row with
    its ``target`` (the schema it lives in)."""
    conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(database.view)))
    for table in ("jobs", "effect_results"):
        union = sql.SQL(" UNION ALL ").join(
            sql.SQL("SELECT t.*, {}::text AS target FROM {}.{} t").format(
                sql.Literal(schema), sql.Identifier(schema), sql.Identifier(table))
            for schema in database.targets)
        conn.execute(sql.SQL("CREATE VIEW {}.{} AS {}").format(
            sql.Identifier(database.view), sql.Identifier(table), union))


def release(database: Database) -> None:
    """Drop what the run created, then stop the embedded server if the run owns one.
    Safe to call after a failure at any point."""
    try:
        _drop(database)
    finally:
        if database.server is not None:
            database.server.stop()


def _drop(database: Database) -> None:
    for attempt in range(10):  # the server may be coming back from a restart
        try:
            with connect(database.admin_dsn) as conn:
                if database.own_database is not None:
                    conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                        sql.Identifier(database.own_database)))
                    return
                for schema in (database.view, *database.targets, database.chaos):
                    conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                        sql.Identifier(schema)))
                return
        except psycopg.OperationalError:
            if attempt == 9:
                raise
            time.sleep(0.5)
