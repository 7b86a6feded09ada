"""The PostgreSQL server the benchmarks run on, and a fresh database per measurement.

Every system measured gets a database of its own, created before and dropped after, so
no system sees another's tables, dead tuples or statistics.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import outbox
from outbox.testing import start_server

log = logging.getLogger("benchmarks")


@dataclass(frozen=True)
class Server:
    """A PostgreSQL server reachable at ``dsn`` (any database on it; we create our own)."""

    dsn: str
    embedded: bool

    def database(self, name: str) -> str:
        """Connection string of database ``name`` on this server."""
        return make_conninfo(self.dsn, dbname=name)

    def version(self) -> str:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            row = conn.execute("SHOW server_version").fetchone()
        return str(row[0]) if row else "unknown"

    def settings(self, names: tuple[str, ...]) -> dict[str, str]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            return {n: str(conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(n)))
                           .fetchall()[0][0]) for n in names}


@contextlib.contextmanager
def server(dsn: str | None, settings: Mapping[str, str] | None = None) -> Iterator[Server]:
    """The server at ``dsn``, or an embedded one in a temporary directory, removed after,
    started with the server parameters ``settings`` (an embedded one only)."""
    if dsn:
        yield Server(dsn, embedded=False)
        return
    # start_server also makes XDG_RUNTIME_DIR private (0700)
    with start_server(settings=settings or None) as embedded:
        yield Server(embedded.dsn, embedded=True)


@contextlib.contextmanager
def fresh_database(srv: Server, label: str) -> Iterator[str]:
    """Create an empty database for one measurement; drop it afterwards."""
    name = f"bench_{label}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(srv.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield srv.database(name)
    finally:
        with psycopg.connect(srv.dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)")
                         .format(sql.Identifier(name)))


def migrated(dsn: str, schema: str = "outbox") -> None:
    """Create the outbox schema in the database at ``dsn``."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        outbox.migrate(conn, schema=schema)


def settle(dsn: str) -> None:
    """What autovacuum and the checkpointer would do after a bulk load, done now, so it
    does not land inside the measured window: VACUUM ANALYZE of every user table, then
    CHECKPOINT."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        tables = [sql.Identifier(schema, name) for schema, name in conn.execute(
            "SELECT schemaname, relname FROM pg_stat_user_tables").fetchall()]
        if tables:
            conn.execute(sql.SQL("VACUUM (ANALYZE) {}").format(sql.SQL(", ").join(tables)))
        try:
            conn.execute("CHECKPOINT")
        except psycopg.errors.InsufficientPrivilege:
            log.info("no privilege to CHECKPOINT; measuring without it")


def scalar(dsn: str, query: sql.Composed | sql.SQL | str, params: Any = None) -> Any:
    """The first column of the first row of ``query``."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(query, params).fetchone()
    return None if row is None else row[0]


def table(schema: str, name: str) -> sql.Composed:
    """``schema.name`` as quoted identifiers."""
    return sql.SQL("{}.{}").format(sql.Identifier(schema), sql.Identifier(name))


def asyncpg_params(dsn: str) -> dict[str, Any]:
    """Keyword arguments of ``asyncpg.connect`` for a libpq connection string."""
    parts = conninfo_to_dict(dsn)
    params: dict[str, Any] = {"database": parts.get("dbname"), "user": parts.get("user")}
    if parts.get("host"):
        params["host"] = parts["host"]
    if parts.get("port"):
        params["port"] = int(str(parts["port"]))
    if parts.get("password"):
        params["password"] = parts["password"]
    return params
