"""Flows: what a completion hook runs in, and what a reconciler answers.

A completion hook (``Effect.on_done`` / ``Effect.on_failed``, or a function given to the
dispatcher as ``on_done={effect: fn}`` / ``on_failed={...}``) runs inside the one
transaction that records the job's outcome: the fenced status change, the ledger row,
the hook's own writes and the follow-up jobs it enqueues commit together or not at all.
It receives a ``HookTransaction`` (``AsyncHookTransaction`` for an ``async def`` hook on
``AsyncDispatcher``).

``Effect.reconcile(job)`` answers for a job whose outcome is unknown: ``Performed(result)``
(the provider acted: the result goes to the ledger, the job to ``done``, ``on_done``
runs), ``NotPerformed()`` (the provider has no trace: the job runs again under the same
key) or ``None`` (still unknown: asked again later).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import psycopg
from pydantic import BaseModel

from ._enqueue import EnqueueResult, NewJob, Payload
from .transaction import AsyncTransaction, Transaction

__all__ = ["AsyncHookTransaction", "HookTransaction", "NotPerformed", "Performed", "Reconciled"]


@dataclass(frozen=True, slots=True)
class Performed:
    """The provider did act for the job: ``result`` is what it returned (stored in the
    ledger, as ``perform``'s return value would have been).

    :var result: What the provider returned for the job (a mapping, a pydantic model or
        None), stored in the ledger row.
    """

    result: Mapping[str, Any] | BaseModel | None = None


@dataclass(frozen=True, slots=True)
class NotPerformed:
    """The provider has no trace of the job: performing it again under the same key
    cannot act twice."""


Reconciled = Performed | NotPerformed | None


class _AnsweredCursor(psycopg.Cursor[Any]):
    """A hook's cursor in the dispatcher's pipeline (its chunk's hooks send their
    statements without waiting for each answer): ``rowcount``, ``statusmessage`` and
    ``description`` wait for the statement's answer, as without a pipeline (the rows
    already do)."""

    def _answered(self) -> None:
        if self.pgresult is None and self.connection.pgconn.pipeline_status:
            with self.connection.pipeline():  # a nested block syncs
                pass

    @property
    def rowcount(self) -> int:
        self._answered()
        return super().rowcount

    @property
    def statusmessage(self) -> str | None:
        self._answered()
        return super().statusmessage

    @property
    def description(self) -> list[psycopg.Column] | None:
        self._answered()
        return super().description


class _AnsweredAsyncCursor(psycopg.AsyncCursor[Any]):
    """An ``async def`` hook's cursor in the dispatcher's pipeline: its rows are awaited
    as always (``await cursor.fetchone()``), but ``rowcount``, ``statusmessage`` and
    ``description`` are not awaited, so cannot wait: before the statement's answer came
    they raise, saying how to wait for it, rather than answer -1 or None."""

    def _answered(self, what: str) -> None:
        if self.pgresult is None and self.connection.pgconn.pipeline_status:
            raise psycopg.InterfaceError(
                f"cursor.{what} is not known yet: the dispatcher sends an async hook's "
                "statements in a pipeline and this one's answer has not come; "
                "`await tx.sync()` first (or fetch its rows: `await cursor.fetchall()`)")

    @property
    def rowcount(self) -> int:
        self._answered("rowcount")
        return super().rowcount

    @property
    def statusmessage(self) -> str | None:
        self._answered("statusmessage")
        return super().statusmessage

    @property
    def description(self) -> list[psycopg.Column] | None:
        self._answered("description")
        return super().description


class HookTransaction(Transaction):
    """The transaction a completion hook runs in, on the dispatcher's connection.

    ``connection`` is that transaction's connection; ``execute(query, params=None)`` runs
    business SQL on it; ``enqueue`` / ``enqueue_many`` add follow-up jobs with the usual
    rules (the same key and payload is a no-op, another payload raises
    ``IdempotencyKeyConflict``) and wake idle dispatchers when it commits. Everything the
    hook writes commits with the job's fenced status change and its ledger row, or not
    at all: a hook that raises has its writes rolled back (up to a savepoint of its own,
    so the rest of the batch is not disturbed). Do not commit or roll back here.

    Follow-ups remember the job that enqueued them (``parent_key``), which the dashboard
    shows as the job's chain. Give them the parent's ``ordering_key`` to have the chain
    run in order after other jobs of that key.
    """

    def __init__(self, conn: psycopg.Connection[Any], schema: str = "outbox") -> None:
        super().__init__(conn, schema)
        self.created: list[int] = []  # follow-up job ids this hook created

    def execute(self, query: Any, params: Any = None) -> psycopg.Cursor[Any]:
        """Run ``query`` with ``params`` in the hook's transaction; return the cursor.

        The dispatcher sends the statements of a chunk's hooks in a pipeline, waiting
        for their answers once, after the last hook: the cursor returned waits for its
        own when asked (its rows, ``rowcount``, ``statusmessage``, ``description``), and
        a statement that fails may raise only then, or in a later statement (the job
        is then written again, its hook called again on its own)."""
        if not self.connection.pgconn.pipeline_status:
            return self.connection.execute(query, params)
        cursor = _AnsweredCursor(self.connection)
        return cursor.execute(query, params)

    def enqueue(
        self, effect: str, *, key: str, payload: Payload,
        run_at: datetime | timedelta | None = None, ordering_key: str | None = None,
        max_attempts: int | None = None, group: str | None = None, priority: int = 0,
        after: Iterable[str] | None = None, after_failed: str = "fail",
    ) -> EnqueueResult:
        """As ``outbox.Transaction.enqueue``, in the hook's transaction."""
        result = super().enqueue(effect, key=key, payload=payload, run_at=run_at,
                                 ordering_key=ordering_key, max_attempts=max_attempts,
                                 group=group, priority=priority, after=after,
                                 after_failed=after_failed)
        self._adopt([result])
        return result

    def enqueue_many(self, jobs: Iterable[NewJob]) -> list[EnqueueResult]:
        """As ``outbox.Transaction.enqueue_many``, in the hook's transaction."""
        results = super().enqueue_many(jobs)
        self._adopt(results)
        return results

    def _adopt(self, results: list[EnqueueResult]) -> None:
        self.created.extend(r.job_id for r in results if r.created and r.job_id is not None)


class AsyncHookTransaction(AsyncTransaction):
    """The ``async def`` hook's mirror of ``HookTransaction``, on ``AsyncDispatcher``'s
    asyncio connection: the same guarantees, awaited."""

    def __init__(self, conn: psycopg.AsyncConnection[Any], schema: str = "outbox") -> None:
        super().__init__(conn, schema)
        self.created: list[int] = []

    async def execute(self, query: Any, params: Any = None) -> psycopg.AsyncCursor[Any]:
        """Run ``query`` with ``params`` in the hook's transaction; return the cursor.

        The dispatcher sends the statements of a chunk's hooks in a pipeline, waiting
        for their answers once, after the last hook: the cursor's rows are awaited as
        always (``await cursor.fetchone()``), which waits for its answer; its
        ``rowcount``, ``statusmessage`` and ``description`` raise until the answer came
        (``await tx.sync()`` waits for it). A statement that fails may raise only
        then, or in a later statement (the job is then written again, its hook called
        again on its own)."""
        if not self.connection.pgconn.pipeline_status:
            return await self.connection.execute(query, params)
        cursor = _AnsweredAsyncCursor(self.connection)
        return await cursor.execute(query, params)

    async def sync(self) -> None:
        """Wait for the answers to every statement sent so far in the hook's
        transaction (raising the first error among them): in the dispatcher's pipeline,
        what a cursor's ``rowcount`` needs. Outside a pipeline, nothing to wait for."""
        if self.connection.pgconn.pipeline_status:
            async with self.connection.pipeline():  # a nested block syncs
                pass

    async def enqueue(
        self, effect: str, *, key: str, payload: Payload,
        run_at: datetime | timedelta | None = None, ordering_key: str | None = None,
        max_attempts: int | None = None, group: str | None = None, priority: int = 0,
        after: Iterable[str] | None = None, after_failed: str = "fail",
    ) -> EnqueueResult:
        """As ``outbox.AsyncTransaction.enqueue``, in the hook's transaction."""
        result = await super().enqueue(effect, key=key, payload=payload, run_at=run_at,
                                       ordering_key=ordering_key, max_attempts=max_attempts,
                                       group=group, priority=priority, after=after,
                                       after_failed=after_failed)
        self.created.extend([result.job_id] if result.created and result.job_id else [])
        return result

    async def enqueue_many(self, jobs: Iterable[NewJob]) -> list[EnqueueResult]:
        """As ``outbox.AsyncTransaction.enqueue_many``, in the hook's transaction."""
        results = await super().enqueue_many(jobs)
        self.created.extend(r.job_id for r in results if r.created and r.job_id is not None)
        return results
