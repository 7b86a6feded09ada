"""Enqueue inside the business transaction: ``outbox.transaction(conn)``.

``Transaction`` (for ``psycopg.Connection``) and ``AsyncTransaction`` (for
``psycopg.AsyncConnection``) are thin mirrors over the pure preparation in ``_enqueue``:
the same validation, the same SQL, the same results.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any, overload

import psycopg
from psycopg.rows import tuple_row

from . import _enqueue
from ._enqueue import EnqueueResult, NewJob, Payload, PreparedJob
from ._sql import queries
from .errors import InvalidKey, InvalidPayload

__all__ = ["AsyncTransaction", "Transaction", "transaction"]

Row = tuple[Any, ...]


def _prepare_many(jobs: Iterable[NewJob]) -> list[PreparedJob]:
    prepared = []
    for index, job in enumerate(jobs):
        try:
            prepared.append(
                _enqueue.prepare(job.effect, job.key, job.payload, job.run_at,
                                 job.ordering_key, job.max_attempts)
            )
        except (InvalidKey, InvalidPayload) as exc:
            raise type(exc)(f"job #{index} ({job.key!r}): {exc}") from None
    return prepared


def _single_result(job: PreparedJob, rows: Sequence[Row]) -> EnqueueResult | None:
    """Interpret the enqueue query's rows; None when a concurrent insert hid the key."""
    if not rows:
        return None
    if rows[0][1]:
        return EnqueueResult(job_id=rows[0][0], created=True)
    existing = next((r for r in rows if r[0] is not None), rows[0])
    return _enqueue.existing_result(job, existing[0], existing[2], existing[3])


def _many_results(
    jobs: Sequence[PreparedJob], unique: Sequence[PreparedJob], created: dict[str, int],
    found: dict[str, Row],
) -> list[EnqueueResult]:
    by_key: dict[str, EnqueueResult] = {}
    for job in unique:
        if job.key in created:
            by_key[job.key] = EnqueueResult(job_id=created[job.key], created=True)
        else:
            row = found[job.key]
            by_key[job.key] = _enqueue.existing_result(job, row[1], row[2], row[3])
    results = []
    reported: set[str] = set()
    for job in jobs:
        result = by_key[job.key]
        # A key repeated within one batch is created once; its repeats report created=False.
        if job.key in reported and result.created:
            result = EnqueueResult(job_id=result.job_id, created=False)
        reported.add(job.key)
        results.append(result)
    return results


class Transaction:
    """A business transaction on a ``psycopg.Connection`` that can enqueue jobs.

    Atomic intent: the jobs enqueued in the block commit if and only if the block's
    transaction commits. If the connection is already inside a transaction, the block is
    a savepoint in it and the jobs commit when the caller commits. Enqueue is idempotent
    per key: see ``enqueue``.
    """

    def __init__(self, conn: psycopg.Connection[Any], schema: str = "outbox") -> None:
        self.connection = conn
        self.schema = schema
        self._queries = queries(schema)
        self._channel = _enqueue.notify_channel(schema)
        self._tx: AbstractContextManager[psycopg.Transaction] | None = None

    def _cursor(self) -> psycopg.Cursor[Row]:
        # Our own row factory: the caller's connection may use dict rows or others.
        return self.connection.cursor(row_factory=tuple_row)

    def __enter__(self) -> Transaction:
        tx = self.connection.transaction()
        tx.__enter__()
        self._tx = tx
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._tx is not None, "Transaction used without 'with'"
        self._tx.__exit__(exc_type, exc, tb)
        self._tx = None

    def enqueue(
        self, effect: str, *, key: str, payload: Payload,
        run_at: datetime | timedelta | None = None, ordering_key: str | None = None,
        max_attempts: int | None = None,
    ) -> EnqueueResult:
        """Record that ``effect`` must be performed once for ``key``, with ``payload``.

        If ``key`` already names a job or a ledger row with the same effect and payload,
        nothing is written and ``created`` is False. The same key with another effect or
        payload raises ``IdempotencyKeyConflict``. ``run_at`` (aware datetime or delay)
        defers the first attempt; jobs sharing an ``ordering_key`` run one at a time, in
        enqueue order. Invalid input raises an ``EnqueueError`` before anything is sent.
        """
        job = _enqueue.prepare(effect, key, payload, run_at, ordering_key, max_attempts)
        params = _enqueue.single_params(job, self._channel)
        rows = self._cursor().execute(self._queries.enqueue, params).fetchall()
        result = _single_result(job, rows)
        if result is None:  # inserted concurrently, committed after our snapshot
            found = self._cursor().execute(self._queries.lookup_keys, {"keys": [key]})
            row = found.fetchone()
            assert row is not None
            result = _enqueue.existing_result(job, row[1], row[2], row[3])
        return result

    def enqueue_many(self, jobs: Iterable[NewJob]) -> list[EnqueueResult]:
        """Enqueue many jobs in one round trip (two if some keys already exist).

        Same semantics as ``enqueue`` for each job, results in input order. If any job is
        invalid or conflicts, ``EnqueueError`` is raised and, as the block then rolls
        back, none of them is kept.
        """
        prepared = _prepare_many(jobs)
        unique = _enqueue.dedupe_batch(prepared)
        if not unique:
            return []
        params = _enqueue.many_params(unique, self._channel)
        rows = self._cursor().execute(self._queries.enqueue_many, params).fetchall()
        created = {row[0]: row[1] for row in rows if row[0] is not None}
        found: dict[str, Row] = {}
        missing = [job.key for job in unique if job.key not in created]
        if missing:
            cur = self._cursor().execute(self._queries.lookup_keys, {"keys": missing})
            found = {row[0]: row for row in cur.fetchall()}
        return _many_results(prepared, unique, created, found)


class AsyncTransaction:
    """The ``psycopg.AsyncConnection`` mirror of ``Transaction``, with the same guarantees."""

    def __init__(self, conn: psycopg.AsyncConnection[Any], schema: str = "outbox") -> None:
        self.connection = conn
        self.schema = schema
        self._queries = queries(schema)
        self._channel = _enqueue.notify_channel(schema)
        self._tx: AbstractAsyncContextManager[psycopg.AsyncTransaction] | None = None

    def _cursor(self) -> psycopg.AsyncCursor[Row]:
        return self.connection.cursor(row_factory=tuple_row)

    async def __aenter__(self) -> AsyncTransaction:
        tx = self.connection.transaction()
        await tx.__aenter__()
        self._tx = tx
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._tx is not None, "AsyncTransaction used without 'async with'"
        await self._tx.__aexit__(exc_type, exc, tb)
        self._tx = None

    async def enqueue(
        self, effect: str, *, key: str, payload: Payload,
        run_at: datetime | timedelta | None = None, ordering_key: str | None = None,
        max_attempts: int | None = None,
    ) -> EnqueueResult:
        """As ``Transaction.enqueue``."""
        job = _enqueue.prepare(effect, key, payload, run_at, ordering_key, max_attempts)
        params = _enqueue.single_params(job, self._channel)
        cur = await self._cursor().execute(self._queries.enqueue, params)
        result = _single_result(job, await cur.fetchall())
        if result is None:
            cur = await self._cursor().execute(self._queries.lookup_keys, {"keys": [key]})
            row = await cur.fetchone()
            assert row is not None
            result = _enqueue.existing_result(job, row[1], row[2], row[3])
        return result

    async def enqueue_many(self, jobs: Iterable[NewJob]) -> list[EnqueueResult]:
        """As ``Transaction.enqueue_many``."""
        prepared = _prepare_many(jobs)
        unique = _enqueue.dedupe_batch(prepared)
        if not unique:
            return []
        params = _enqueue.many_params(unique, self._channel)
        cur = await self._cursor().execute(self._queries.enqueue_many, params)
        created = {row[0]: row[1] for row in await cur.fetchall() if row[0] is not None}
        found: dict[str, Row] = {}
        missing = [job.key for job in unique if job.key not in created]
        if missing:
            cur = await self._cursor().execute(self._queries.lookup_keys, {"keys": missing})
            found = {row[0]: row for row in await cur.fetchall()}
        return _many_results(prepared, unique, created, found)


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
    inside an open transaction the block is a savepoint of it.
    """
    if isinstance(conn, psycopg.AsyncConnection):
        return AsyncTransaction(conn, schema)
    if isinstance(conn, psycopg.Connection):
        return Transaction(conn, schema)
    raise TypeError(
        f"outbox.transaction() needs a psycopg.Connection or AsyncConnection, "
        f"got {type(conn).__name__}"
    )
