"""Enqueue and receive inside the business transaction: ``outbox.transaction(conn)``.

Every transaction kind is a thin shell over the pure steps of ``_enqueue``: it opens and
closes its block and executes a named query, nothing else. ``Operations`` and
``AsyncOperations`` hold the public methods once for all kinds (psycopg here, SQLAlchemy
and Django in ``outbox.contrib``), so they all validate, write and answer alike.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any, overload

import psycopg
from psycopg.rows import tuple_row

from . import _enqueue, tracing
from ._enqueue import EnqueueResult, NewJob, Payload, Row
from ._sql import queries

__all__ = ["AsyncOperations", "AsyncTransaction", "Operations", "Transaction", "transaction"]

class Operations:
    """``enqueue``, ``enqueue_many`` and ``receive`` for a synchronous transaction kind.

    A kind sets ``schema`` and implements ``_execute(name, params)``: run the named block
    of ``queries.sql`` (bound to ``schema``) in the caller's transaction, return its rows.
    """

    schema: str

    def _execute(self, name: str, params: dict[str, Any]) -> list[Row]:
        raise NotImplementedError

    def enqueue(
        self, effect: str, *, key: str, payload: Payload,
        run_at: datetime | timedelta | None = None, ordering_key: str | None = None,
        max_attempts: int | None = None,
    ) -> EnqueueResult:
        """Record that ``effect`` must be performed once for ``key``, with ``payload``.

        The job commits if and only if the transaction the block belongs to commits.
        If ``key`` already names a job or a ledger row with the same effect and payload,
        nothing is written and ``created`` is False. The same key with another effect or
        payload raises ``IdempotencyKeyConflict``. ``run_at`` (aware datetime or delay)
        defers the first attempt; jobs sharing an ``ordering_key`` run one at a time, in
        enqueue order. Invalid input raises an ``EnqueueError`` before anything is sent.
        """
        job = _enqueue.prepare(effect, key, payload, run_at, ordering_key, max_attempts)
        steps = _enqueue.enqueue_steps(job, _enqueue.notify_channel(self.schema))
        return _enqueue.run_steps(steps, self._execute)

    def enqueue_many(self, jobs: Iterable[NewJob]) -> list[EnqueueResult]:
        """Enqueue many jobs in one round trip (two if some keys already exist).

        Same semantics as ``enqueue`` for each job, results in input order. If any job is
        invalid or conflicts, ``EnqueueError`` is raised and, as the block then rolls
        back, none of them is kept.
        """
        prepared = _enqueue.prepare_many(jobs)
        steps = _enqueue.enqueue_many_steps(prepared, _enqueue.notify_channel(self.schema))
        return _enqueue.run_steps(steps, self._execute)

    def receive(self, consumer: str, message_id: str) -> bool:
        """Record that ``consumer`` received ``message_id``: the inbox of an idempotent consumer.

        True the first time, False for a repeat (a transaction that recorded it has
        committed, so its work is done: skip it). The row is written in the block's
        transaction, so if the handling rolls back, the message counts as not received.
        A concurrent receive of the same message waits for the first one's transaction:
        of two, exactly one gets True. Both names follow the key rules (1..255 printable
        ASCII characters), else ``InvalidKey``. Rows are purged after the retention.
        """
        return _enqueue.run_steps(_enqueue.receive_steps(consumer, message_id), self._execute)


class AsyncOperations:
    """The asynchronous mirror of ``Operations``: same methods, awaited."""

    schema: str

    async def _execute(self, name: str, params: dict[str, Any]) -> list[Row]:
        raise NotImplementedError

    async def enqueue(
        self, effect: str, *, key: str, payload: Payload,
        run_at: datetime | timedelta | None = None, ordering_key: str | None = None,
        max_attempts: int | None = None,
    ) -> EnqueueResult:
        """As ``Operations.enqueue``."""
        job = _enqueue.prepare(effect, key, payload, run_at, ordering_key, max_attempts)
        steps = _enqueue.enqueue_steps(job, _enqueue.notify_channel(self.schema))
        return await _enqueue.run_steps_async(steps, self._execute)

    async def enqueue_many(self, jobs: Iterable[NewJob]) -> list[EnqueueResult]:
        """As ``Operations.enqueue_many``."""
        prepared = _enqueue.prepare_many(jobs)
        steps = _enqueue.enqueue_many_steps(prepared, _enqueue.notify_channel(self.schema))
        return await _enqueue.run_steps_async(steps, self._execute)

    async def receive(self, consumer: str, message_id: str) -> bool:
        """As ``Operations.receive``."""
        steps = _enqueue.receive_steps(consumer, message_id)
        return await _enqueue.run_steps_async(steps, self._execute)


class Transaction(Operations):
    """A business transaction on a ``psycopg.Connection`` that can enqueue and receive.

    Atomic intent: the jobs enqueued in the block commit if and only if the block's
    transaction commits. If the connection is already inside a transaction, the block is
    a savepoint in it and the jobs commit when the caller commits. Enqueue is idempotent
    per key: see ``enqueue``.
    """

    def __init__(self, conn: psycopg.Connection[Any], schema: str = "outbox") -> None:
        self.connection = conn
        self.schema = schema
        self._queries = queries(schema)
        self._tx: AbstractContextManager[psycopg.Transaction] | None = None
        self._trace: Any = None  # the block's producer spans (outbox.tracing)

    def _execute(self, name: str, params: dict[str, Any]) -> list[Row]:
        # Our own row factory: the caller's connection may use dict rows or others.
        cur = self.connection.cursor(row_factory=tuple_row)
        cur.execute(getattr(self._queries, name), params)
        return cur.fetchall() if cur.description else []

    def __enter__(self) -> Transaction:
        tx = self.connection.transaction()
        tx.__enter__()
        self._tx = tx
        self._trace = tracing.open_block()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._tx is not None, "Transaction used without 'with'"
        try:
            self._tx.__exit__(exc_type, exc, tb)
        except BaseException as failed:  # the commit itself failed: nothing was sent
            tracing.close_block(self._trace, failed)
            raise
        finally:
            self._tx = None
        tracing.close_block(self._trace, exc)


class AsyncTransaction(AsyncOperations):
    """The ``psycopg.AsyncConnection`` mirror of ``Transaction``, with the same guarantees."""

    def __init__(self, conn: psycopg.AsyncConnection[Any], schema: str = "outbox") -> None:
        self.connection = conn
        self.schema = schema
        self._queries = queries(schema)
        self._tx: AbstractAsyncContextManager[psycopg.AsyncTransaction] | None = None
        self._trace: Any = None  # the block's producer spans (outbox.tracing)

    async def _execute(self, name: str, params: dict[str, Any]) -> list[Row]:
        cur = self.connection.cursor(row_factory=tuple_row)
        await cur.execute(getattr(self._queries, name), params)
        return await cur.fetchall() if cur.description else []

    async def __aenter__(self) -> AsyncTransaction:
        tx = self.connection.transaction()
        await tx.__aenter__()
        self._tx = tx
        self._trace = tracing.open_block()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._tx is not None, "AsyncTransaction used without 'async with'"
        try:
            await self._tx.__aexit__(exc_type, exc, tb)
        except BaseException as failed:  # the commit itself failed: nothing was sent
            tracing.close_block(self._trace, failed)
            raise
        finally:
            self._tx = None
        tracing.close_block(self._trace, exc)


@overload
def transaction(conn: psycopg.AsyncConnection[Any], *, schema: str = ...) -> AsyncTransaction: ...
@overload
def transaction(conn: psycopg.Connection[Any], *, schema: str = ...) -> Transaction: ...
def transaction(
    conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any], *, schema: str = "outbox"
) -> Transaction | AsyncTransaction:
    """Open a business transaction that can enqueue jobs, on a sync or async connection.

    Use ``with`` for a ``psycopg.Connection`` and ``async with`` for a
    ``psycopg.AsyncConnection``. The jobs commit or roll back with the business writes;
    inside an open transaction the block is a savepoint of it; on an idle connection the
    block is the transaction and commits when it ends.

    Warning: do not pass a connection borrowed from an ORM (SQLAlchemy's
    ``session.connection().connection.driver_connection``, Django's
    ``connection.connection``). Both ORMs begin lazily: until they run a statement the
    driver connection is idle, so this block would begin and commit a transaction of its
    own, and a later rollback through the ORM would leave the jobs committed and the
    business rows gone. Use ``outbox.contrib.sqlalchemy.transaction(session)`` or
    ``outbox.contrib.django.transaction()``, which open the block through the ORM.
    """
    if isinstance(conn, psycopg.AsyncConnection):
        return AsyncTransaction(conn, schema)
    if isinstance(conn, psycopg.Connection):
        return Transaction(conn, schema)
    raise TypeError(
        f"outbox.transaction() needs a psycopg.Connection or AsyncConnection, "
        f"got {type(conn).__name__}"
    )
