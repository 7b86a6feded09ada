"""Enqueue and receive inside a SQLAlchemy 2 transaction: ``transaction(session)``.

::

    from outbox.contrib.sqlalchemy import transaction as outbox_tx

    with Session(engine) as session, session.begin():
        session.add(Order(id=102))
        with outbox_tx(session) as tx:
            tx.enqueue("email.send", key="email-order-102", payload={"order": 102})

The block is a savepoint (``begin_nested()``) of the ORM's transaction; if none is open
yet, the ORM begins it (its autobegin), and it stays the caller's to commit or roll back.
Statements run through the ORM's connection with ``text()``, so the jobs commit if and
only if the ORM's transaction commits, whatever ran before the block, and the block never
commits a transaction. An exception in the block (``IdempotencyKeyConflict`` too) rolls
back the savepoint: the block's jobs go, the session stays usable. Tested on the
``postgresql+psycopg``, ``postgresql+psycopg2`` and ``postgresql+asyncpg`` drivers.
"""

from __future__ import annotations

import re
from functools import cache
from types import TracebackType
from typing import Any, overload

try:  # outbox-pg[sqlalchemy]
    from sqlalchemy import Connection, TextClause, text
except ModuleNotFoundError as exc:
    from .._extras import missing_extra

    raise missing_extra(exc, "outbox.contrib.sqlalchemy", "sqlalchemy") from exc
from sqlalchemy.engine import NestedTransaction
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession, async_scoped_session
from sqlalchemy.ext.asyncio import AsyncTransaction as _SAAsyncTransaction
from sqlalchemy.ext.asyncio.session import AsyncSessionTransaction
from sqlalchemy.orm import Session, SessionTransaction, scoped_session

from .._sql import queries
from .._steps import Rows, Statement, shaped
from ..transaction import AsyncOperations, Operations

__all__ = ["AsyncTransaction", "Transaction", "colon_params", "transaction"]

_PYFORMAT = re.compile(r"%\((\w+)\)s")
# A colon that text() would take for the start of a bind parameter (its own rule: not
# after a colon, word character or backslash); escaped so only our parameters bind.
_TEXT_COLON = re.compile(r"(?<![:\w\\]):(?=\w)")
_CAST_AFTER_PARAM = re.compile(r"%\(\w+\)s::")


def colon_params(query: str) -> str:
    """A named block (``%(name)s`` parameters) rewritten for SQLAlchemy's ``text()``.

    ``%(name)s`` becomes ``:name``, ``%%`` becomes ``%`` and any other colon text() would
    read as a parameter is escaped. A parameter followed by a ``::`` cast is refused:
    text() would read ``:key::text`` as a parameter named ``ke``.
    """
    bad = _CAST_AFTER_PARAM.search(query)
    if bad:
        raise ValueError(
            f"{bad.group()!r}: a parameter cast with '::' cannot run through text(); "
            "write CAST(%(name)s AS type)"
        )
    return _PYFORMAT.sub(r":\1", _TEXT_COLON.sub(r"\\:", query)).replace("%%", "%")


@cache
def _text(query: str) -> TextClause:
    """``query`` (a bound block of ``enqueue.sql``) as ``text()``, made once per block."""
    return text(colon_params(query))


def _rows(result: Any, statement: Statement) -> Rows:
    if statement.count:
        return [(result.rowcount,)]
    return shaped(statement, list(result.keys()), result) if result.returns_rows else []


class Transaction(Operations):
    """An outbox block inside the transaction of a ``Session`` or ``Connection``.

    Same ``enqueue`` / ``enqueue_many`` / ``receive`` as ``outbox.Transaction``; the block
    is a savepoint of the ORM's transaction and never commits it.
    """

    def __init__(self, target: Session | Connection, schema: str = "outbox") -> None:
        self.target = target
        self.schema = schema
        self._queries = queries(schema)  # an impossible schema name fails here
        self._savepoint: SessionTransaction | NestedTransaction | None = None

    def _execute(self, statement: Statement) -> Rows:
        target = self.target
        connection = target.connection() if isinstance(target, Session) else target
        query = _text(statement.query)
        return _rows(connection.execute(query, statement.params), statement)

    def __enter__(self) -> Transaction:
        self._savepoint = self.target.begin_nested()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        savepoint, self._savepoint = self._savepoint, None
        assert savepoint is not None, "Transaction used without 'with'"
        if not savepoint.is_active:  # the caller ended it inside the block
            return
        if exc_type is None:
            savepoint.commit()
        else:
            savepoint.rollback()


class AsyncTransaction(AsyncOperations):
    """The ``AsyncSession`` / ``AsyncConnection`` mirror of ``Transaction``."""

    def __init__(self, target: AsyncSession | AsyncConnection, schema: str = "outbox") -> None:
        self.target = target
        self.schema = schema
        self._queries = queries(schema)
        self._savepoint: AsyncSessionTransaction | _SAAsyncTransaction | None = None

    async def _execute(self, statement: Statement) -> Rows:
        target = self.target
        connection = await target.connection() if isinstance(target, AsyncSession) else target
        query = _text(statement.query)
        return _rows(await connection.execute(query, statement.params), statement)

    async def __aenter__(self) -> AsyncTransaction:
        self._savepoint = await self.target.begin_nested()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        savepoint, self._savepoint = self._savepoint, None
        assert savepoint is not None, "AsyncTransaction used without 'async with'"
        failure = self._check_awaited(exc)  # a call never awaited: roll back, say so
        if not savepoint.is_active:
            pass
        elif failure is None:
            await savepoint.commit()
        else:
            await savepoint.rollback()
        if failure is not None and failure is not exc:
            raise failure


@overload
def transaction(
    target: AsyncSession | AsyncConnection | async_scoped_session[Any], *, schema: str = ...
) -> AsyncTransaction: ...
@overload
def transaction(
    target: Session | Connection | scoped_session[Any], *, schema: str = ...
) -> Transaction: ...
def transaction(
    target: Session | Connection | scoped_session[Any] | AsyncSession | AsyncConnection
    | async_scoped_session[Any],
    *, schema: str = "outbox",
) -> Transaction | AsyncTransaction:
    """Open an outbox block in the SQLAlchemy transaction of ``target``.

    ``with`` for a ``Session`` or ``Connection``, ``async with`` for an ``AsyncSession``
    or ``AsyncConnection`` (a ``scoped_session`` stands for its current session). The
    jobs commit if and only if the ORM's transaction commits; the block is a savepoint
    and never commits a transaction itself.
    """
    if isinstance(target, scoped_session | async_scoped_session):
        target = target()  # the registry's current session (Flask-SQLAlchemy's db.session)
    if isinstance(target, AsyncSession | AsyncConnection):
        return AsyncTransaction(target, schema)
    if isinstance(target, Session | Connection):
        return Transaction(target, schema)
    raise TypeError(
        "outbox.contrib.sqlalchemy.transaction() needs a Session, Connection, AsyncSession "
        f"or AsyncConnection, got {type(target).__name__}"
    )
