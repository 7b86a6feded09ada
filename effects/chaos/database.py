"""Where a chaos run keeps its data: a database of its own, dropped at the end.

Without a DSN the runner starts an embedded PostgreSQL in its work directory and owns
it (so it may restart it). With a DSN it never touches other data: it creates a database
of its own (``outbox_chaos_<id>``) and drops it afterwards; if it may not create
databases, it falls back to two schemas of its own in the DSN's database, dropped
afterwards. It never restarts a server it does not own.
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

__all__ = ["Database", "connect", "provision", "release"]

log = logging.getLogger("effects.chaos")


def connect(dsn: str, name: str = "chaos runner") -> psycopg.Connection[Any]:
    """An autocommit connection of the runner (never named "outbox ...": the runner's
    own connections are not targets of the terminate fault)."""
    return psycopg.connect(dsn, autocommit=True, connect_timeout=5, application_name=name)


@dataclass
class Database:
    """The run's database. ``dsn`` reaches it; ``schema`` holds the outbox tables and
    ``chaos`` the audit and business rows. ``server`` is the embedded server when the
    run owns one; ``own_database`` the database created for the run, if any."""

    admin_dsn: str
    dsn: str
    schema: str
    chaos: str
    own_database: str | None
    server: Server | None

    @property
    def restartable(self) -> bool:
        """Whether the run owns the server and so may restart it."""
        return self.server is not None

    @property
    def mode(self) -> str:
        """How the run is isolated, for the report."""
        where = "embedded PostgreSQL" if self.server is not None else "--dsn server"
        what = f"database {self.own_database}" if self.own_database else \
            f"schemas {self.schema}, {self.chaos}"
        return f"{where}, {what}"

    def restart(self) -> float:
        """Restart the owned server (every connection drops); return the seconds taken."""
        if self.server is None:
            raise RuntimeError("the run does not own this PostgreSQL server")
        started = time.monotonic()
        self.server.restart()
        return time.monotonic() - started


def provision(dsn: str | None, work_dir: Path) -> Database:
    """Start or reach the server, create the run's own database (or schemas), migrate."""
    server = None
    if dsn is None:
        server = start_server(work_dir / "data")
        dsn = server.dsn
    run_id = uuid.uuid4().hex[:10]
    try:
        database = _own_database(dsn, f"outbox_chaos_{run_id}", server)
    except psycopg.errors.InsufficientPrivilege:
        log.warning("may not create a database here: using schemas of the run's own")
        database = Database(dsn, dsn, f"outbox_chaos_{run_id}", f"chaos_audit_{run_id}",
                            None, server)
    try:
        _create_tables(database)
    except BaseException:
        release(database)
        raise
    return database


def _own_database(admin_dsn: str, name: str, server: Server | None) -> Database:
    with connect(admin_dsn) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return Database(admin_dsn, make_conninfo(admin_dsn, dbname=name), "outbox", "chaos",
                    name, server)


def _create_tables(database: Database) -> None:
    with connect(database.dsn) as conn:
        outbox.migrate(conn, schema=database.schema)
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(database.chaos)))
        queries = chaos_queries(database.schema, database.chaos)
        conn.execute(queries.create_tables)
        conn.execute(queries.create_consumed)


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
                for schema in (database.schema, database.chaos):
                    conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                        sql.Identifier(schema)))
                return
        except psycopg.OperationalError:
            if attempt == 9:
                raise
            time.sleep(0.5)
