"""A connection lost in the middle of a claim round strands no job.

A round claims the limited effects' jobs first, then the rest in one claim. When the
connection is lost between the two, the limited jobs are already held: they must still
reach the workers. Held and never handed over, the heartbeat would keep their leases
alive for ever, no dispatcher would perform them, and a stop would wait for them
without end (a chaos worker that did not stop within 30 s of SIGTERM).
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import psycopg

import outbox
from outbox import DispatchStats, Effect, Job, NewJob
from outbox._dispatch.claimer import Claimer, run_claimer, run_claimer_async
from outbox._dispatch.connection import AsyncConnection, Connection, connect
from outbox._dispatch.settings import Settings
from outbox._dispatch.state import Held, LoopEvent, SharedState
from outbox._steps import Statement
from outbox.observe import DispatchObserver

SAFETY_BOUND = 60.0  # seconds: ends a run that strands the job instead of hanging


class Limited(Effect):
    name = "test.limited"

    def perform(self, job: Job) -> None:
        raise AssertionError("not performed in this test")


class Plain(Effect):
    name = "test.plain"

    def perform(self, job: Job) -> None:
        raise AssertionError("not performed in this test")


class CutBeforeCoreClaim(Connection):
    """The claimer's real connection; its server backend is terminated (by another
    connection, as an operator or a failover would) just before the first core claim
    statement is sent, so that statement meets a real connection loss."""

    def __init__(self, settings: Settings, dsn: str) -> None:
        super().__init__(lambda role: connect(settings, role), "claimer")
        self._core_claim = settings.queries.claim
        self._dsn = dsn
        self.cut = False

    def execute(self, statement: Statement) -> Any:
        if statement.query == self._core_claim and not self.cut:
            self.cut = True
            pid = self.get().info.backend_pid
            with psycopg.connect(self._dsn, autocommit=True) as other:
                other.execute("SELECT pg_terminate_backend(%s, 10000)", (pid,))
        return super().execute(statement)


def enqueue_one_of_each(dsn: str, schema: str) -> Settings:
    with psycopg.connect(dsn) as business, outbox.transaction(business, schema=schema) as tx:
        tx.enqueue_many([NewJob("test.limited", "limited-1", {}),
                         NewJob("test.plain", "plain-1", {})])
    return Settings.build(dsn, [Limited(), Plain()], schema=schema, lease=30,
                          limits={"test.limited": outbox.Limit(concurrency=4)})


def test_jobs_claimed_before_a_connection_loss_in_the_same_round_reach_the_workers(
    dsn: str, schema: str
) -> None:
    settings = enqueue_one_of_each(dsn, schema)
    state: SharedState[threading.Event] = SharedState(DispatchStats(), DispatchObserver(),
                                                      4, threading.Event)
    conn = CutBeforeCoreClaim(settings, dsn)
    submitted: list[Held] = []

    def submit(batch: list[Held]) -> None:
        submitted.extend(batch)
        if {"limited-1", "plain-1"} <= {h.job.key for h in submitted}:
            state.request_stop()

    try:
        run_claimer(Claimer(settings, state, until_idle=False), conn, submit,
                    deadline=time.monotonic() + SAFETY_BOUND)
    finally:
        conn.discard()

    assert conn.cut, "the core claim was never sent: the test did not cut anything"
    keys = [h.job.key for h in submitted]
    assert sorted(keys) == ["limited-1", "plain-1"]  # each handed over, once
    assert set(state.held) == {h.job.id for h in submitted}  # nothing held unsubmitted
    assert state.stats.reconnects == 1  # the loss was still seen and counted


class AsyncCutBeforeCoreClaim(AsyncConnection):
    """``CutBeforeCoreClaim`` for ``AsyncDispatcher``'s claimer."""

    def __init__(self, settings: Settings, dsn: str) -> None:
        super().__init__(settings, "claimer")
        self._core_claim = settings.queries.claim
        self._dsn = dsn
        self.cut = False

    async def execute(self, statement: Statement) -> Any:
        if statement.query == self._core_claim and not self.cut:
            self.cut = True
            pid = (await self.get()).info.backend_pid
            async with await psycopg.AsyncConnection.connect(self._dsn,
                                                             autocommit=True) as other:
                await other.execute("SELECT pg_terminate_backend(%s, 10000)", (pid,))
        return await super().execute(statement)


def test_the_async_claimer_hands_over_jobs_claimed_before_a_connection_loss(
    dsn: str, schema: str
) -> None:
    settings = enqueue_one_of_each(dsn, schema)

    async def claim() -> tuple[AsyncCutBeforeCoreClaim, SharedState[LoopEvent], list[Held]]:
        state: SharedState[LoopEvent] = SharedState(DispatchStats(), DispatchObserver(), 4,
                                                    LoopEvent)
        conn = AsyncCutBeforeCoreClaim(settings, dsn)
        submitted: list[Held] = []

        def submit(batch: list[Held]) -> None:
            submitted.extend(batch)
            if {"limited-1", "plain-1"} <= {h.job.key for h in submitted}:
                state.request_stop()

        try:
            await run_claimer_async(Claimer(settings, state, until_idle=False), conn, submit,
                                    deadline=time.monotonic() + SAFETY_BOUND)
        finally:
            await conn.discard()
        return conn, state, submitted

    conn, state, submitted = asyncio.run(claim())
    assert conn.cut, "the core claim was never sent: the test did not cut anything"
    assert sorted(h.job.key for h in submitted) == ["limited-1", "plain-1"]
    assert set(state.held) == {h.job.id for h in submitted}
    assert state.stats.reconnects == 1
