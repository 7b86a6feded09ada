"""Enqueue and receive inside the business transaction: ``outbox.transaction(conn)``.

Every transaction kind is a thin shell over the pure steps of ``_enqueue``: it opens and
closes its block and executes a ``Statement``, nothing else (``_steps``'s drivers run the
steps). One exception, for speed: psycopg's ``Transaction.enqueue_many`` sends a large
batch in parts through psycopg's pipeline (``ENQUEUE_PART``), built from the same
pieces of ``_enqueue`` as the step. ``Operations`` and ``AsyncOperations`` hold the
public methods once for all kinds (psycopg here, SQLAlchemy and Django in
``outbox.contrib``), so they all validate, write and answer alike.
"""

from __future__ import annotations

import inspect
from collections.abc import Coroutine, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any, NoReturn, TypeVar, overload

import psycopg
from psycopg.pq import ExecStatus
from psycopg.pq.abc import PGresult
from psycopg.rows import namedtuple_row

from . import _enqueue, tracing
from ._enqueue import EnqueueResult, NewJob, Payload
from ._pg import read_only, unmigrated
from ._sql import Queries, queries
from ._steps import Rows, Statement, Step, row_factory, run, run_async

T = TypeVar("T")
_TUPLES_OK = ExecStatus.TUPLES_OK

__all__ = ["AsyncOperations", "AsyncTransaction", "Operations", "Transaction", "transaction"]


def _raise_as_ours(exc: Exception, schema: str) -> None:
    """If ``exc`` means the schema is not migrated, or the server is a read-only standby,
    raise our error that says so (``outbox._pg``), from it; else return (the caller
    re-raises ``exc`` unchanged). A function, not a context manager: it is on the path of
    every enqueue only when one fails."""
    missing = unmigrated(exc, schema) or read_only(exc)
    if missing is not None:
        raise missing from exc


class Operations:
    """``enqueue``, ``enqueue_many`` and ``receive`` for a synchronous transaction kind.

    A kind sets ``schema`` and ``_queries`` (``queries(schema)``) and implements
    ``_execute(statement)``: run it in the caller's transaction, return its rows.
    """

    schema: str
    _queries: Queries

    def _execute(self, statement: Statement) -> Rows:
        raise NotImplementedError

    async def __aenter__(self) -> NoReturn:
        raise TypeError(
            f"{type(self).__name__} is synchronous (a blocking connection): open it with "
            "`with`, not `async with`; for asyncio, give it an asynchronous connection")

    async def __aexit__(self, *exc_info: object) -> None:
        """Never reached: ``__aenter__`` refuses."""

    def enqueue(
        self, effect: str, *, key: str, payload: Payload,
        run_at: datetime | timedelta | None = None, ordering_key: str | None = None,
        max_attempts: int | None = None, group: str | None = None, priority: int = 0,
        after: Iterable[str] | None = None, after_failed: str = "fail",
    ) -> EnqueueResult:
        """Record that ``effect`` must be performed once for ``key``, with ``payload``.

        The job commits if and only if the transaction the block belongs to commits.
        If ``key`` already names a job or a ledger row with the same effect and payload,
        nothing is written and ``created`` is False. The same key with another effect or
        payload raises ``IdempotencyKeyConflict``. ``run_at`` (aware datetime or delay)
        defers the first attempt; jobs sharing an ``ordering_key`` run one at a time, in
        enqueue order. ``group`` (a tenant, customer or account; at most 255 characters)
        makes claims fair: an effect's due jobs are claimed across groups in turn.
        ``priority`` (-1000..1000, higher first) lets a job overtake lower ones of its
        group, each level counting as 10 seconds of waiting, so lower ones still run.
        ``after`` (keys of jobs enqueued before, in this transaction or an earlier one,
        or already done) makes the job wait: it is not due until every one of them is
        done, and then ``job.after_results`` maps each to its ledger result. A parent
        that fails for good fails the job too (never performed; ``last_error`` names
        the parent), unless ``after_failed="run"``. A key that names no job and no ledger
        row raises ``UnknownParent``. Invalid input raises an ``EnqueueError`` before
        anything is sent.
        """
        job = _enqueue.prepare(effect, key, payload, run_at, ordering_key, max_attempts,
                               group, priority, after, after_failed)
        return self._run(_enqueue.enqueue_steps(job, self._queries))

    def _run(self, step: Step[T]) -> T:
        try:
            return run(step, self._execute)
        except Exception as exc:
            _raise_as_ours(exc, self.schema)
            raise

    def enqueue_many(self, jobs: Iterable[NewJob]) -> list[EnqueueResult]:
        """Enqueue many jobs in one round trip (two if some keys already exist).

        Same semantics as ``enqueue`` for each job, results in input order. If any job is
        invalid or conflicts, ``EnqueueError`` is raised and, as the block then rolls
        back, none of them is kept.
        """
        prepared = _enqueue.prepare_many(jobs)
        return self._run(_enqueue.enqueue_many_steps(prepared, self._queries))

    def receive(self, consumer: str, message_id: str) -> bool:
        """Record that ``consumer`` received ``message_id``: the inbox of an idempotent consumer.

        True the first time, False for a repeat (a transaction that recorded it has
        committed, so its work is done: skip it). The row is written in the block's
        transaction, so if the handling rolls back, the message counts as not received.
        A concurrent receive of the same message waits for the first one's transaction:
        of two, exactly one gets True. Both names follow the key rules (1..255 printable
        ASCII characters), else ``InvalidKey``. Rows are purged after the retention.
        """
        return self._run(_enqueue.receive_steps(consumer, message_id, self._queries))

    def resolve_performed(self, key: str, result: Mapping[str, Any] | None, *,
                          source: str) -> int | None:
        """The provider says the job ``key`` was performed (its own event, e.g. a Stripe
        webhook naming the key): the id of the job resolved, or None.

        A job in ``reconcile``, or ``pending`` between attempts, goes back to
        ``pending`` with ``result`` kept: the next claim records it without calling the
        provider, runs ``on_done`` and writes the ledger row in the fenced done
        transaction. A running, done or failed job is left alone. Written in the block's
        transaction and audited as the reconciler's decision (``source`` says whence).
        """
        return self._run(_enqueue.resolve_steps(key, result, source, self._queries))

    def receive_many(self, consumer: str, message_ids: Sequence[str]) -> list[bool]:
        """``receive`` for many messages in one round trip: for each id, in order, True
        the first time (an id repeated in ``message_ids`` is True once), False for a
        repeat. Same transaction, waiting and validation rules as ``receive``."""
        return self._run(_enqueue.receive_many_steps(consumer, message_ids, self._queries))


class AsyncOperations:
    """The asynchronous mirror of ``Operations``: same methods, awaited.

    A call that is never awaited (``tx.enqueue(...)`` without ``await``) writes
    nothing; the block finds it when it exits and raises ``RuntimeError`` naming the
    call, so the block rolls back instead of committing without the job.
    """

    schema: str
    _queries: Queries

    async def _execute(self, statement: Statement) -> Rows:
        raise NotImplementedError

    def __enter__(self) -> NoReturn:
        raise TypeError(
            f"{type(self).__name__} is asynchronous (an asyncio connection): open it with "
            "`async with`, not `with`, and `await tx.enqueue(...)`")

    def __exit__(self, *exc_info: object) -> None:
        """Never reached: ``__enter__`` refuses."""

    def enqueue(
        self, effect: str, *, key: str, payload: Payload,
        run_at: datetime | timedelta | None = None, ordering_key: str | None = None,
        max_attempts: int | None = None, group: str | None = None, priority: int = 0,
        after: Iterable[str] | None = None, after_failed: str = "fail",
    ) -> Coroutine[Any, Any, EnqueueResult]:
        """As ``Operations.enqueue``; await it."""
        call = self._enqueue_one(effect, key, payload, run_at, ordering_key, max_attempts,
                                 group, priority, after, after_failed)
        return self._issued(call, f"tx.enqueue({effect!r}, key={key!r}, ...)")

    async def _enqueue_one(
        self, effect: str, key: str, payload: Payload, run_at: datetime | timedelta | None,
        ordering_key: str | None, max_attempts: int | None, group: str | None = None,
        priority: int = 0, after: Iterable[str] | None = None, after_failed: str = "fail",
    ) -> EnqueueResult:
        job = _enqueue.prepare(effect, key, payload, run_at, ordering_key, max_attempts,
                               group, priority, after, after_failed)
        return await self._run(_enqueue.enqueue_steps(job, self._queries))

    async def _run(self, step: Step[T]) -> T:
        try:
            return await run_async(step, self._execute)
        except Exception as exc:
            _raise_as_ours(exc, self.schema)
            raise

    def enqueue_many(self, jobs: Iterable[NewJob]) -> Coroutine[Any, Any, list[EnqueueResult]]:
        """As ``Operations.enqueue_many``; await it."""
        return self._issued(self._enqueue_batch(jobs), "tx.enqueue_many(...)")

    async def _enqueue_batch(self, jobs: Iterable[NewJob]) -> list[EnqueueResult]:
        prepared = _enqueue.prepare_many(jobs)
        return await self._run(_enqueue.enqueue_many_steps(prepared, self._queries))

    def receive(self, consumer: str, message_id: str) -> Coroutine[Any, Any, bool]:
        """As ``Operations.receive``; await it."""
        return self._issued(self._receive_one(consumer, message_id),
                            f"tx.receive({consumer!r}, {message_id!r})")

    async def _receive_one(self, consumer: str, message_id: str) -> bool:
        return await self._run(_enqueue.receive_steps(consumer, message_id, self._queries))

    def resolve_performed(self, key: str, result: Mapping[str, Any] | None, *,
                          source: str) -> Coroutine[Any, Any, int | None]:
        """As ``Operations.resolve_performed``; await it."""
        return self._issued(self._run(_enqueue.resolve_steps(key, result, source, self._queries)),
                            f"tx.resolve_performed({key!r}, ...)")

    def receive_many(self, consumer: str,
                     message_ids: Sequence[str]) -> Coroutine[Any, Any, list[bool]]:
        """As ``Operations.receive_many``; await it."""
        return self._issued(
            self._run(_enqueue.receive_many_steps(consumer, message_ids, self._queries)),
                            f"tx.receive_many({consumer!r}, ...)")

    def _issued(self, call: Coroutine[Any, Any, T], what: str) -> Coroutine[Any, Any, T]:
        issued: list[tuple[Coroutine[Any, Any, Any], str]] | None = getattr(
            self, "_issued_calls", None)
        if issued is None:
            issued = []
            self._issued_calls = issued
        elif len(issued) >= _PRUNE_AT:  # a long block: forget the calls already awaited
            issued[:] = [(c, w) for c, w in issued if _never_started(c)]
        issued.append((call, what))
        return call

    def _check_awaited(self, exc: BaseException | None) -> BaseException | None:
        """At the block's exit: the error to exit with if a call was never awaited (the
        block then rolls back), else ``exc``. Closes such calls (no later warning)."""
        issued: list[tuple[Coroutine[Any, Any, Any], str]] = getattr(self, "_issued_calls", [])
        self._issued_calls = []
        forgotten = [what for call, what in issued if _never_started(call)]
        for call, _ in issued:
            if _never_started(call):
                call.close()
        if not forgotten or exc is not None:
            return exc
        return RuntimeError(
            f"{forgotten[0]} was never awaited, so it wrote nothing"
            f"{f' (nor {len(forgotten) - 1} more call(s))' if len(forgotten) > 1 else ''}: "
            "write `await tx.enqueue(...)`; the block rolled back")


_PRUNE_AT = 256


def _has_rows(result: PGresult | None) -> bool:
    """Whether a statement's result holds rows to fetch (a SELECT, a RETURNING)."""
    return result is not None and result.status == _TUPLES_OK


def _never_started(call: Coroutine[Any, Any, Any]) -> bool:
    return inspect.getcoroutinestate(call) == inspect.CORO_CREATED


ENQUEUE_PART = 250
"""``enqueue_many`` on a psycopg connection sends a batch of at least twice this many jobs
in parts of this many, each prepared while the server inserts the one before."""


def _sent_in_parts(batch: Sequence[NewJob],
                   conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
    """Whether ``enqueue_many`` sends ``batch`` in parts (``_enqueue.BatchInParts``): a
    batch of a few parts, no job waiting on parents (their checks need the whole batch
    first), no span to open for it, and not inside the caller's own pipeline."""
    return (len(batch) >= 2 * ENQUEUE_PART and not tracing.enabled()
            and not conn.pgconn.pipeline_status
            and not any(getattr(job, "after", None) for job in batch))


def _as_sequence(jobs: Iterable[NewJob]) -> Sequence[NewJob]:
    return jobs if isinstance(jobs, Sequence) else list(jobs)


class Transaction(Operations):
    """A business transaction on a ``psycopg.Connection`` that can enqueue and receive.

    Atomic intent: the jobs enqueued in the block commit if and only if the block's
    transaction commits. If the connection is already inside a transaction, the block is
    a savepoint in it and the jobs commit when the caller commits. Enqueue is idempotent
    per key: see ``enqueue``.

    ``enqueue_many`` of a large batch overlaps the client's work with the server's: the
    jobs are prepared in parts (``ENQUEUE_PART``), each part sent in psycopg's pipeline
    while the next is prepared, where one statement would make the server wait for the
    whole batch's preparation and the client for the whole insert. Its guarantees are
    ``Operations.enqueue_many``'s: a job found invalid in a later part takes back what
    the earlier parts created, so the batch keeps nothing.
    """

    def __init__(self, conn: psycopg.Connection[Any], schema: str = "outbox") -> None:
        self.connection = conn
        self.schema = schema
        self._queries = queries(schema)
        self._tx: AbstractContextManager[psycopg.Transaction] | None = None
        self._trace: Any = None  # the block's producer spans (outbox.tracing)

    def _execute(self, statement: Statement) -> Rows:
        # Our own row factory: the caller's connection may use dict rows or others.
        cur = self.connection.cursor(row_factory=row_factory(statement))
        if self.connection.pgconn.pipeline_status:
            # In the caller's pipeline a statement's answer comes only at a sync point:
            # a nested block syncs, so the rows (or the error) are known here.
            with self.connection.pipeline():
                cur.execute(statement.query, statement.params)
        else:
            cur.execute(statement.query, statement.params)
        if statement.count:
            return [(cur.rowcount,)]
        # Rows only from a statement that answers some; read from the result's status,
        # not from cur.description, which builds a list of columns at each call.
        return cur.fetchall() if _has_rows(cur.pgresult) else []

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

    def enqueue_many(self, jobs: Iterable[NewJob]) -> list[EnqueueResult]:
        """As ``Operations.enqueue_many``: results in input order; an invalid or
        conflicting job raises ``EnqueueError`` and the batch keeps nothing."""
        batch = _as_sequence(jobs)
        if not _sent_in_parts(batch, self.connection):
            return super().enqueue_many(batch)
        try:
            return self._enqueue_in_parts(_enqueue.BatchInParts(batch, ENQUEUE_PART,
                                                                self.schema))
        except Exception as exc:
            _raise_as_ours(exc, self.schema)
            raise

    def _enqueue_in_parts(self, batch: _enqueue.BatchInParts) -> list[EnqueueResult]:
        conn, queries_ = self.connection, self._queries
        sent: list[psycopg.Cursor[Any]] = []
        with conn.pipeline():
            for params in batch.parts():
                sent.append(cur := conn.cursor(row_factory=namedtuple_row))
                cur.execute(queries_.enqueue_many, params)
                conn.pgconn.flush()  # sent: inserted while the next part is prepared
        # The pipeline synced when left: every part's rows (or its error) are here.
        created = batch.answered([row for cur in sent for row in cur.fetchall()])
        if batch.refused is not None:
            if created:
                conn.execute(queries_.enqueue_withdrawn, {"ids": created})
            raise batch.refused
        found: list[Any] = []
        if missing := batch.missing():
            lookup: psycopg.Cursor[Any] = conn.cursor(row_factory=namedtuple_row)
            found = lookup.execute(queries_.lookup_keys, {"keys": missing}).fetchall()
        return batch.results(found)


class AsyncTransaction(AsyncOperations):
    """The ``psycopg.AsyncConnection`` mirror of ``Transaction``, with the same guarantees
    (``enqueue_many`` of a large batch in parts, as there)."""

    def __init__(self, conn: psycopg.AsyncConnection[Any], schema: str = "outbox") -> None:
        self.connection = conn
        self.schema = schema
        self._queries = queries(schema)
        self._tx: AbstractAsyncContextManager[psycopg.AsyncTransaction] | None = None
        self._trace: Any = None  # the block's producer spans (outbox.tracing)

    async def _execute(self, statement: Statement) -> Rows:
        cur = self.connection.cursor(row_factory=row_factory(statement))
        if self.connection.pgconn.pipeline_status:  # as in Transaction._execute
            async with self.connection.pipeline():
                await cur.execute(statement.query, statement.params)
        else:
            await cur.execute(statement.query, statement.params)
        if statement.count:
            return [(cur.rowcount,)]
        return await cur.fetchall() if _has_rows(cur.pgresult) else []

    async def _enqueue_batch(self, jobs: Iterable[NewJob]) -> list[EnqueueResult]:
        batch = _as_sequence(jobs)
        if not _sent_in_parts(batch, self.connection):
            return await super()._enqueue_batch(batch)
        try:
            return await self._enqueue_in_parts(_enqueue.BatchInParts(batch, ENQUEUE_PART,
                                                                      self.schema))
        except Exception as exc:
            _raise_as_ours(exc, self.schema)
            raise

    async def _enqueue_in_parts(self, batch: _enqueue.BatchInParts) -> list[EnqueueResult]:
        conn, queries_ = self.connection, self._queries
        sent: list[psycopg.AsyncCursor[Any]] = []
        async with conn.pipeline():
            for params in batch.parts():
                sent.append(cur := conn.cursor(row_factory=namedtuple_row))
                await cur.execute(queries_.enqueue_many, params)
                conn.pgconn.flush()  # sent: inserted while the next part is prepared
        created = batch.answered([row for cur in sent for row in await cur.fetchall()])
        if batch.refused is not None:
            if created:
                await conn.execute(queries_.enqueue_withdrawn, {"ids": created})
            raise batch.refused
        found: list[Any] = []
        if missing := batch.missing():
            lookup: psycopg.AsyncCursor[Any] = conn.cursor(row_factory=namedtuple_row)
            found = await (await lookup.execute(queries_.lookup_keys,
                                                {"keys": missing})).fetchall()
        return batch.results(found)

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
        failure = self._check_awaited(exc)
        forgotten = failure is not None and failure is not exc
        if failure is not None and forgotten:  # never awaited: roll back, and say why
            exc_type, exc, tb = type(failure), failure, None
        try:
            await self._tx.__aexit__(exc_type, exc, tb)
        except BaseException as failed:  # the commit itself failed: nothing was sent
            tracing.close_block(self._trace, failed)
            raise
        finally:
            self._tx = None
        tracing.close_block(self._trace, exc)
        if forgotten:
            assert failure is not None
            raise failure


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
