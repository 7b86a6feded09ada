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

try:  # outbox[django]
    from django.conf import settings
except ModuleNotFoundError as exc:
    from ..._extras import missing_extra

    raise missing_extra(exc, "outbox.contrib.django", "django") from exc
from django.db import connections
from django.db import transaction as django_transaction
from psycopg.conninfo import make_conninfo

from ..._sql import queries
from ..._steps import Rows, Statement, shaped
from ...transaction import Operations
from ._schema import flush

__all__ = ["Transaction", "conninfo", "default_schema", "flush", "jobs", "transaction"]


def default_schema() -> str:
    """The outbox schema of this project: ``settings.OUTBOX_SCHEMA``, else ``"outbox"``."""
    return str(getattr(settings, "OUTBOX_SCHEMA", "outbox"))


class Transaction(Operations):
    """An outbox block that is a ``django.db.transaction.atomic`` block on ``using``.

    The jobs commit if and only if the outermost ``atomic()`` commits; an exception in
    the block rolls back its writes and its jobs (a savepoint when nested). Same
    ``enqueue`` / ``enqueue_many`` / ``receive`` as ``outbox.Transaction``.
    """

    def __init__(self, using: str = "default", schema: str | None = None) -> None:
        self.using = using
        self.schema = default_schema() if schema is None else schema
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
    ``settings.OUTBOX_SCHEMA`` or ``"outbox"``.
    """
    return Transaction(using, schema)


def jobs(using: str = "default", *, schema: str | None = None) -> list[dict[str, Any]]:
    """The jobs as ``using``'s current transaction sees them, in enqueue order.

    For tests inside Django's ``TestCase``, whose transaction no dispatcher can see: each
    job is a dict with ``id``, ``effect``, ``key``, ``payload`` (decoded), ``status``,
    ``group_key`` and ``priority``.
    """
    schema = default_schema() if schema is None else schema
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
