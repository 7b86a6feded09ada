"""Enqueue and receive inside Django's ``transaction.atomic``: ``transaction()``.

::

    from outbox.contrib.django import transaction as outbox_atomic

    with outbox_atomic() as tx:                 # django.db.transaction.atomic(using=...)
        Order.objects.create(id=102)
        tx.enqueue("email.send", key="email-order-102", payload={
            "from": "shop@example.com", "to": "ada@example.com",
            "subject": "Order 102", "text": "Thank you!"})

The block *is* an ``atomic()`` block: outermost it begins and commits a transaction, nested
(inside another ``atomic()``, an ``ATOMIC_REQUESTS`` view, a ``TestCase``) it is a
savepoint and the jobs commit when the outermost block commits. Statements run through
Django's cursor, so its savepoints, error wrapping and query logging apply. Works with the
PostgreSQL backend on psycopg 3 and psycopg2.

Also a Django app: with ``"outbox.contrib.django"`` in ``INSTALLED_APPS``,
``manage.py migrate`` creates the outbox tables (also in the test runner's database) with
outbox's own SQL files, recorded by Django and in ``<schema>.schema_migrations`` alike, so
``manage.py outbox migrate`` agrees with it in either order; every later ``migrate``
applies the SQL files a newer outbox brings. ``manage.py flush``, which
``TransactionTestCase`` runs after each test, empties the outbox tables too.
``manage.py outbox <migrate|run|status|retry|web> ...`` is the ``outbox`` command with
the connection string taken from ``DATABASES`` (``--database`` picks the alias). The
schema is ``settings.OUTBOX_SCHEMA`` (default ``"outbox"``).

django-tenants (a schema per tenant): with ``"outbox.contrib.django"`` in ``TENANT_APPS``
and ``OUTBOX_SCHEMA_PER_TENANT = True``, each tenant's outbox lives in the tenant's own
schema (``migrate_schemas`` creates it there), ``transaction()`` enqueues into the schema
of the tenant the connection is set to (``connection.set_tenant``, a request, a
``tenant_context``; outside one, the public schema, whose outbox ``SHARED_APPS`` makes),
and ``Dispatcher(effects=[...], targets=tenant_targets)`` serves every tenant's outbox,
a tenant added later included.

Tests: Django's ``TestCase`` runs each test inside a transaction that it rolls back, and
no other connection sees uncommitted rows. A ``Dispatcher`` works on connections of its
own, so inside a ``TestCase`` it finds none of the test's jobs (it is not a bug: the jobs
would commit only with the test's transaction, which never commits). There, assert on the
enqueued jobs through the test's own connection (``jobs()`` below). To run the effects,
use ``TransactionTestCase``, whose writes really commit, and drain with
``Dispatcher(conninfo(), effects=[...]).run_until_idle()``."""

from __future__ import annotations

import json
from types import TracebackType
from typing import Any

import psycopg

try:  # outbox-pg[django]
    from django.conf import settings
except ModuleNotFoundError as exc:
    from ..._extras import missing_extra

    raise missing_extra(exc, "outbox.contrib.django", "django") from exc
from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from django.db import transaction as django_transaction
from psycopg.conninfo import make_conninfo

from ..._extras import missing_extra
from ..._sql import queries
from ..._steps import Rows, Statement, shaped
from ...targets import Target
from ...transaction import Operations
from ._schema import APP_LABEL, flush
from ._schema import _queries as _schema_queries

__all__ = ["Transaction", "conninfo", "default_schema", "flush", "jobs", "tenant_targets",
           "transaction"]


def _per_tenant() -> bool:
    """Whether each tenant has an outbox in its own schema: ``OUTBOX_SCHEMA_PER_TENANT``
    (django-tenants). Setting ``OUTBOX_SCHEMA`` too is refused: it would mean nothing."""
    if not getattr(settings, "OUTBOX_SCHEMA_PER_TENANT", False):
        return False
    if hasattr(settings, "OUTBOX_SCHEMA"):
        raise ImproperlyConfigured(
            "OUTBOX_SCHEMA_PER_TENANT puts each tenant's outbox in the tenant's own schema; "
            "remove OUTBOX_SCHEMA, or OUTBOX_SCHEMA_PER_TENANT for one outbox shared by "
            "every tenant")
    return True


def default_schema(using: str = "default") -> str:
    """The outbox schema of this project on ``using``: ``settings.OUTBOX_SCHEMA``, else
    ``"outbox"``.

    With ``OUTBOX_SCHEMA_PER_TENANT = True`` (django-tenants), the schema of the tenant
    ``using``'s connection is set to now (``connection.schema_name``: by
    ``connection.set_tenant``, the tenant middleware, ``tenant_context``), the public
    schema when none is.
    """
    if not _per_tenant():
        return str(getattr(settings, "OUTBOX_SCHEMA", "outbox"))
    schema = getattr(connections[using], "schema_name", None)
    if not isinstance(schema, str) or not schema:
        raise ImproperlyConfigured(
            f"OUTBOX_SCHEMA_PER_TENANT needs django-tenants' backend on DATABASES[{using!r}] "
            "(ENGINE 'django_tenants.postgresql_backend'): its connection has no tenant "
            "schema")
    return schema


class Transaction(Operations):
    """An outbox block that is a ``django.db.transaction.atomic`` block on ``using``.

    The jobs commit if and only if the outermost ``atomic()`` commits; an exception in
    the block rolls back its writes and its jobs (a savepoint when nested). Same
    ``enqueue`` / ``enqueue_many`` / ``receive`` as ``outbox.Transaction``.
    """

    def __init__(self, using: str = "default", schema: str | None = None) -> None:
        self.using = using
        self.schema = default_schema(using) if schema is None else schema
        self._queries = queries(self.schema)
        self._atomic: django_transaction.Atomic | None = None

    def _execute(self, statement: Statement) -> Rows:
        with connections[self.using].cursor() as cursor:
            cursor.execute(statement.query, statement.params)
            if statement.count:
                return [(cursor.rowcount,)]
            if not cursor.description:
                return []
            return shaped(statement, [c[0] for c in cursor.description], cursor.fetchall())

    def __enter__(self) -> Transaction:
        atomic = django_transaction.atomic(using=self.using)
        atomic.__enter__()
        self._atomic = atomic
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        atomic, self._atomic = self._atomic, None
        assert atomic is not None, "Transaction used without 'with'"
        atomic.__exit__(exc_type, exc, tb)


def transaction(using: str = "default", *, schema: str | None = None) -> Transaction:
    """Open an outbox block as ``django.db.transaction.atomic(using=using)``.

    The jobs commit if and only if Django's outermost transaction commits; the block
    never commits a transaction it did not begin. ``schema`` defaults to
    ``settings.OUTBOX_SCHEMA`` or ``"outbox"`` (``default_schema``; with
    ``OUTBOX_SCHEMA_PER_TENANT``, the schema of the tenant ``using`` is set to, read
    when the block opens).
    """
    return Transaction(using, schema)


def jobs(using: str = "default", *, schema: str | None = None) -> list[dict[str, Any]]:
    """The jobs as ``using``'s current transaction sees them, in enqueue order.

    For tests inside Django's ``TestCase``, whose transaction no dispatcher can see: each
    job is a dict with ``id``, ``effect``, ``key``, ``payload`` (decoded), ``status``,
    ``group_key`` and ``priority``.
    """
    schema = default_schema(using) if schema is None else schema
    with connections[using].cursor() as cursor:
        cursor.execute(queries(schema).jobs_in_transaction)
        names = [column[0] for column in cursor.description]
        found = [dict(zip(names, values, strict=True)) for values in cursor.fetchall()]
    return [{**job, "payload": json.loads(job["payload"])} for job in found]


def _libpq_keywords() -> frozenset[str]:
    return frozenset(option.keyword.decode() for option in psycopg.pq.Conninfo.get_defaults())


def conninfo(using: str = "default") -> str:
    """The libpq connection string of ``DATABASES[using]``, for a ``Dispatcher``.

    Built from what Django itself would connect with (``NAME``, ``USER``, ``PASSWORD``,
    ``HOST``, ``PORT`` and the libpq parameters among ``OPTIONS``). It holds the password
    when there is one: pass it on, never log it.
    """
    params = connections[using].get_connection_params()
    keywords = _libpq_keywords()
    kept = {
        key: value for key, value in params.items()
        if key in keywords and isinstance(value, str | int) and value != ""
    }
    return make_conninfo("", **kept)


def tenant_targets(using: str | None = None) -> list[Target]:
    """One ``outbox.Target`` per django-tenants tenant, for ``Dispatcher(effects=[...],
    targets=tenant_targets)``: the dispatcher calls it again every ``targets_interval``,
    so a tenant created while it runs is served from the next read on, one deleted is
    let go.

    Each target is the database of ``using`` (default: django-tenants'
    ``TENANT_DB_ALIAS``, ``"default"``), its connection string as ``conninfo()`` builds
    it, and a schema holding an outbox under ``OUTBOX_SCHEMA_PER_TENANT = True``: every
    tenant's own schema when ``"outbox.contrib.django"`` is in ``TENANT_APPS``, and the
    public schema when it is in ``SHARED_APPS`` (with ``TENANT_TYPES``, each type's
    ``APPS``), as ``migrate_schemas`` decides where to migrate it. In the order of the
    schema names, the public schema first. A schema is listed once its outbox is migrated:
    django-tenants saves a new tenant before ``migrate_schemas`` makes its tables, and a
    schema without them has no job to perform.

    The tenants are read through Django's connection of the calling thread; a connection
    opened for the read is closed after it. Needs ``pip install 'outbox-pg[django-tenants]'``.
    The targets hold the password when there is one: pass them on, never log their
    ``dsn`` (their ``name`` and ``repr`` leave it out).
    """
    try:
        from django_tenants.routers import TenantSyncRouter
        from django_tenants.utils import (
            get_public_schema_name,
            get_tenant_database_alias,
            get_tenant_model,
            get_tenant_types,
            has_multi_type_tenants,
        )
    except ModuleNotFoundError as exc:
        raise missing_extra(exc, "outbox.contrib.django.tenant_targets",
                            "django-tenants") from exc
    if not _per_tenant():
        raise ImproperlyConfigured(
            "tenant_targets() serves an outbox in each tenant's schema: set "
            "OUTBOX_SCHEMA_PER_TENANT = True (one outbox shared by every tenant, in "
            "OUTBOX_SCHEMA, is served by Dispatcher(conninfo(), ...) alone)")
    alias = get_tenant_database_alias() if using is None else using
    public = get_public_schema_name()
    router = TenantSyncRouter()
    multi_type = has_multi_type_tenants()

    def holds_outbox(schema: str, tenant: Any) -> bool:
        if multi_type:
            kind = public if schema == public else tenant.get_tenant_type()
            apps = get_tenant_types()[kind]["APPS"]
        else:
            apps = settings.SHARED_APPS if schema == public else settings.TENANT_APPS
        return bool(router.app_in_list(APP_LABEL, apps))

    connection = connections[alias]
    opened = connection.connection is None
    try:
        tenants = list(get_tenant_model().objects.using(alias).order_by("schema_name"))
        schemas = [public] if holds_outbox(public, None) else []
        schemas += [tenant.schema_name for tenant in tenants if tenant.schema_name != public
                    and holds_outbox(tenant.schema_name, tenant)]
        with connection.cursor() as cursor:
            cursor.execute(_schema_queries(public).migrated_schemas, {"schemas": schemas})
            migrated = {schema for schema, in cursor.fetchall()}
    finally:
        if opened:
            connection.close()
    dsn = conninfo(alias)
    return [Target(dsn, schema) for schema in schemas if schema in migrated]
