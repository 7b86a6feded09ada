"""The outbox tables under Django's ``migrate`` and ``flush``.

``manage.py migrate`` applies outbox's SQL files through Django's own connection and
transaction, with the same statements as ``outbox migrate`` (``outbox.migrate``'s
``apply_through``), so both record the versions in ``<schema>.schema_migrations`` and
either can run first. The app's one Django migration creates the schema; every later
``migrate`` upgrades it (``post_migrate``) to whatever SQL migrations the installed outbox
ships. ``flush`` (which ``TransactionTestCase`` runs after each test) empties the outbox
tables with the rest of the database.

Under django-tenants with ``OUTBOX_SCHEMA_PER_TENANT``, the schema is the one the
connection is set to: ``migrate_schemas`` sets it to each tenant's in turn (and the
public schema), so every schema where the app is installed gets its own outbox tables,
beside the tenant's own; ``flush`` there empties the outbox's tables only.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources
from typing import Any

from django.apps import AppConfig
from django.db import connections, router
from django.db.backends.base.base import BaseDatabaseWrapper
from psycopg import sql

from ..._sql import BoundQueries, bind_schema, check_schema_name, parse_blocks
from ...migrate import apply_through, latest_version, migrations

APP_LABEL = "outbox"


@cache
def _queries(schema: str) -> BoundQueries:
    text = resources.files(__package__).joinpath("queries.sql").read_text("utf-8")
    return BoundQueries({name: bind_schema(body, schema)
                         for name, body in parse_blocks(text).items()},
                        "outbox/contrib/django/queries.sql")


def _schema(using: str) -> str:
    from . import default_schema

    return check_schema_name(default_schema(using))


def _shares_its_schema() -> bool:
    """Whether the outbox tables stand beside other tables in their schema (a tenant's)."""
    from . import _per_tenant

    return _per_tenant()


_CREATE_TABLE = re.compile(r"CREATE TABLE (?:IF NOT EXISTS )?\{schema\}\.(\w+)")


@cache
def outbox_tables() -> frozenset[str]:
    """The tables outbox's SQL migrations create (``schema_migrations`` aside)."""
    return frozenset(name for migration in migrations()
                     for name in _CREATE_TABLE.findall(migration.sql))


def _is_outbox_database(connection: BaseDatabaseWrapper) -> bool:
    # Only PostgreSQL can hold the outbox; a router may keep it off an alias.
    return connection.vendor == "postgresql" and bool(
        router.allow_migrate(connection.alias, APP_LABEL))


def apply_migrations(connection: BaseDatabaseWrapper, schema: str) -> list[int]:
    """Apply outbox's pending SQL migrations to ``schema`` through ``connection`` (a
    Django database), inside ``atomic()``; return the versions applied."""

    def execute(statement: str, params: tuple[Any, ...] | None) -> list[tuple[Any, ...]]:
        with connection.cursor() as cursor:
            cursor.execute(statement, params)
            return [tuple(row) for row in cursor.fetchall()] if cursor.description else []

    from django.db import transaction

    with transaction.atomic(using=connection.alias):
        return apply_through(execute, schema)


def version(connection: BaseDatabaseWrapper, schema: str) -> int | None:
    """``schema``'s applied outbox version on ``connection``; None if never migrated."""
    queries = _queries(schema)
    versions = sql.SQL("{}.schema_migrations").format(sql.Identifier(schema)).as_string(None)
    with connection.cursor() as cursor:
        cursor.execute(queries.has_versions, {"versions": versions})
        (migrated,) = cursor.fetchone()  # the one column, by its one name
        if not migrated:
            return None
        cursor.execute(queries.version)
        (applied,) = cursor.fetchone()
        return int(applied)


def run_sql_migrations(apps: Any, schema_editor: Any) -> None:
    """The Django migration's operation (``RunPython``): create or upgrade the schema."""
    connection = schema_editor.connection
    if connection.vendor == "postgresql":
        apply_migrations(connection, _schema(connection.alias))


def flush(using: str = "default", schema: str | None = None) -> None:
    """Empty every outbox table of ``schema`` on ``using`` (the migrations record stays).

    What ``manage.py flush`` and ``TransactionTestCase`` do for the outbox, called by
    the app on their ``post_migrate``; call it yourself where Django skips that signal
    (a ``TransactionTestCase`` with ``available_apps`` or ``serialized_rollback``).
    With ``OUTBOX_SCHEMA_PER_TENANT`` the schema is shared with the tenant's tables: only
    the outbox's own are emptied.
    """
    schema = check_schema_name(_schema(using) if schema is None else schema)
    connection = connections[using]
    with connection.cursor() as cursor:
        cursor.execute(_queries(schema).data_tables, {"schema_name": schema})
        tables = [table for table, in cursor.fetchall()]
        if _shares_its_schema():
            tables = [table for table in tables if table in outbox_tables()]
        if tables:
            cursor.execute(sql.SQL("TRUNCATE {}").format(sql.SQL(", ").join(
                sql.Identifier(schema, table) for table in tables)).as_string(None))


def after_migrate(sender: AppConfig, *, using: str, **kwargs: Any) -> None:
    """``post_migrate`` of the outbox app: after ``migrate``, bring an existing outbox
    schema up to the installed version; after ``flush``, empty its tables.

    ``flush`` sends the signal without the ``plan`` and ``apps`` that ``migrate`` always
    passes; that absence is how the two are told apart.
    """
    connection = connections[using]
    if not _is_outbox_database(connection):
        return
    schema = _schema(using)
    current = version(connection, schema)
    if current is None:
        return  # never migrated here (the app's migration did not run on this alias)
    if "plan" in kwargs or "apps" in kwargs:
        if current < latest_version():
            apply_migrations(connection, schema)
    else:
        flush(using, schema)
