"""Applies the numbered SQL files of ``migrations/`` to a schema, once each, in order.

Safe to run from several processes at once: the whole run holds a transaction-level
advisory lock derived from the schema name, so concurrent starts queue up and find the
work done. Migrations are forward-only; a database that records a version this code does
not know is refused rather than touched.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.pq import TransactionStatus
from psycopg.rows import scalar_row

from ._pg import configuration_error
from ._sql import bind_schema, check_schema_name
from .errors import SchemaError

__all__ = ["Migration", "current_version", "latest_version", "migrate", "migrations"]

_FILE_NAME = re.compile(r"^(\d{4})_(\w+)\.sql$")
_LOCK_NAMESPACE = "outbox.migrate:"


@dataclass(frozen=True)
class Migration:
    """One forward-only migration file."""

    version: int
    name: str
    sql: str


def _migrations_dir() -> Traversable:
    shipped = resources.files("outbox").joinpath("_migrations")
    if shipped.is_dir():
        return shipped
    # A source checkout (or an editable install): the files live at the repo's top level.
    return Path(__file__).resolve().parent.parent / "migrations"


@cache
def migrations() -> tuple[Migration, ...]:
    """Every migration this code knows, in version order, checked for gaps."""
    found = []
    for entry in _migrations_dir().iterdir():
        match = _FILE_NAME.match(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text("utf-8")))
    found.sort(key=lambda m: m.version)
    for expected, migration in enumerate(found, start=1):
        if migration.version != expected:
            raise SchemaError(f"migration {expected:04d} is missing before {migration.name}")
    if not found:
        raise SchemaError("no migration files found: the package is incomplete")
    return tuple(found)


def latest_version() -> int:
    """The version the schema has once every known migration is applied."""
    return migrations()[-1].version


def _versions_table(schema: str) -> sql.Composed:
    return sql.SQL("{}.schema_migrations").format(sql.Identifier(schema))


def current_version(conn: psycopg.Connection[Any], schema: str = "outbox") -> int | None:
    """The schema's applied version, or None when outbox was never migrated there."""
    check_schema_name(schema)
    cursor = conn.cursor(row_factory=scalar_row)
    exists = cursor.execute(
        "SELECT to_regclass(%s) IS NOT NULL",
        (_versions_table(schema).as_string(conn),),
    ).fetchone()
    if not exists:
        return None
    applied = cursor.execute(
        sql.SQL("SELECT coalesce(max(version), 0) FROM {}").format(_versions_table(schema))
    ).fetchone()
    return int(applied) if applied is not None else 0


def require_current(conn: psycopg.Connection[Any], schema: str) -> None:
    """Raise SchemaError unless ``schema`` is migrated to exactly this code's version;
    ``ConfigurationError`` if the role may not read it."""
    try:
        version = current_version(conn, schema)
    except psycopg.Error as exc:
        fatal = configuration_error(exc, doing=f"read schema {schema!r}")
        if fatal is None:
            raise
        raise fatal from exc
    if version is None:
        raise SchemaError(
            f"schema {schema!r} has no outbox tables: run `outbox migrate` "
            "or outbox.migrate(conn, schema=...) first"
        )
    latest = latest_version()
    if version < latest:
        raise SchemaError(
            f"schema {schema!r} is at version {version}, this code needs {latest}: "
            "run `outbox migrate`"
        )
    if version > latest:
        raise SchemaError(
            f"schema {schema!r} is at version {version}, newer than this code knows "
            f"({latest}): upgrade outbox before running it against this database"
        )


def migrate(conn: psycopg.Connection[Any], schema: str = "outbox") -> list[int]:
    """Create or upgrade the outbox tables in ``schema``; return the versions applied.

    Idempotent, and safe when several processes run it at once (an advisory lock on the
    schema name serialises them; the later ones apply nothing), whatever the database's
    or role's ``default_transaction_isolation``: on an idle connection the run is its
    own READ COMMITTED transaction. All pending migrations apply in one transaction:
    either the schema reaches the latest version or it is left as it was. Joins the
    caller's transaction if ``conn`` is inside one; under REPEATABLE READ or SERIALIZABLE
    that transaction's snapshot may predate a concurrent run, which is then reported as
    a ``SchemaError`` (run it again) rather than applied twice. Needs a direct
    connection, not one through a transaction-pooling PgBouncer.
    """
    check_schema_name(schema)
    if conn.info.transaction_status != TransactionStatus.IDLE:
        return _joined(conn, schema)
    # Under REPEATABLE READ or SERIALIZABLE the snapshot is taken by the first statement,
    # the lock request, before the lock is granted: a run that waited would not see the
    # versions the holder just applied and would apply them again.
    previous = conn.isolation_level
    conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
    try:
        return _apply(conn, schema)
    finally:
        conn.isolation_level = previous


def _joined(conn: psycopg.Connection[Any], schema: str) -> list[int]:
    try:
        return _apply(conn, schema)
    except (psycopg.errors.DuplicateObject, psycopg.errors.DuplicateTable,
            psycopg.errors.DuplicateSchema, psycopg.errors.UniqueViolation,
            psycopg.errors.SerializationFailure) as exc:
        raise SchemaError(
            f"schema {schema!r} was migrated by another process after this transaction's "
            "snapshot was taken: run migrate again in a new transaction"
        ) from exc


def _apply(conn: psycopg.Connection[Any], schema: str) -> list[int]:
    def execute(statement: str, params: tuple[Any, ...] | None) -> list[tuple[Any, ...]]:
        cursor = conn.execute(statement.encode() if params is None else statement, params)
        return cursor.fetchall() if cursor.description else []

    with conn.transaction():
        return apply_through(execute, schema)


Execute = Callable[[str, "tuple[Any, ...] | None"], list[tuple[Any, ...]]]


def apply_through(execute: Execute, schema: str) -> list[int]:
    """Apply the pending migrations of ``schema`` with ``execute(statement, params)``, in
    the caller's transaction; return the versions applied.

    The one sequence every route runs (``migrate`` on a psycopg connection, Django's
    migrations on a Django cursor, on psycopg 3 or psycopg2): the advisory lock, the
    schema and its ``schema_migrations``, then each pending file recorded as it applies.
    Statements are plain strings with ``%s`` placeholders, so any DB-API cursor runs them.
    """
    check_schema_name(schema)
    execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))",
            (_LOCK_NAMESPACE + schema,))
    execute(bind_schema("CREATE SCHEMA IF NOT EXISTS {schema}", schema), None)
    execute(bind_schema("CREATE TABLE IF NOT EXISTS {schema}.schema_migrations ("
                        " version integer PRIMARY KEY,"
                        " name text NOT NULL,"
                        " applied_at timestamptz NOT NULL DEFAULT now())", schema), None)
    [(current,)] = execute(bind_schema(
        "SELECT coalesce(max(version), 0) FROM {schema}.schema_migrations", schema), None)
    version = int(current)
    if version > latest_version():
        raise SchemaError(
            f"schema {schema!r} is at version {version}, newer than this code knows "
            f"({latest_version()}): refusing to migrate"
        )
    applied: list[int] = []
    for migration in migrations():
        if migration.version <= version:
            continue
        execute(bind_schema(migration.sql, schema), None)
        execute(bind_schema("INSERT INTO {schema}.schema_migrations (version, name) "
                            "VALUES (%s, %s)", schema), (migration.version, migration.name))
        applied.append(migration.version)
    return applied
