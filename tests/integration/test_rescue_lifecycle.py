"""The rescue of an expired lease goes through the lifecycle: an unknown outcome, settled
exactly as a ``perform`` that raised ``UnknownOutcome`` is, with the backoff and the
hooks of a perform's outcome (both dispatchers)."""

from __future__ import annotations

import asyncio
import random
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

import outbox
from outbox import AsyncDispatcher, Dispatcher, Effect, Job, UnknownOutcome, _queue
from outbox.sql import queries
from outbox.testing import jobs

EFFECT = "test.unsure"


class Unsure(Effect):
    """Times out after sending (``UnknownOutcome``); its ``on_failed`` writes a row, or
    raises when the payload says so."""

    name = EFFECT

    def __init__(self, schema: str) -> None:
        self.insert = sql.SQL("INSERT INTO {}.hooked (key, error) VALUES (%s, %s)").format(
            sql.Identifier(schema))

    def perform(self, job: Job) -> None:
        raise UnknownOutcome("timeout after send")

    def on_failed(self, tx: outbox.HookTransaction, job: Job, error: BaseException) -> None:
        tx.execute(self.insert, (job.key, f"{type(error).__name__}: {error}"))
        if job.payload.get("hook") == "raise":
            raise RuntimeError("the hook broke")


class AsyncUnsure(Unsure):
    async def perform(self, job: Job) -> None:  # type: ignore[override]
        raise UnknownOutcome("timeout after send")

    async def on_failed(self, tx: outbox.AsyncHookTransaction, job: Job,  # type: ignore[override]
                        error: BaseException) -> None:
        await tx.execute(self.insert, (job.key, f"{type(error).__name__}: {error}"))
        if job.payload.get("hook") == "raise":
            raise RuntimeError("the hook broke")


class TenMinutes(outbox.Backoff):
    """A backoff with its jitter at the top: every retry waits the whole ten minutes."""

    def delay(self, attempt: int, rng: random.Random) -> float:
        return 600.0


def _prepare(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE TABLE {}.hooked (key text NOT NULL, error text)").format(
            sql.Identifier(schema)))


def _enqueue(dsn: str, schema: str, key: str, *, max_attempts: int,
             payload: dict[str, Any] | None = None) -> None:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue(EFFECT, key=key, payload=payload or {}, max_attempts=max_attempts)


def _claimed_by_a_dead_worker(dsn: str, schema: str, key: str, *,
                              cancelled: bool = False) -> None:
    """``key`` claimed by a worker that then died (its lease expired); with
    ``cancelled``, an operator cancelled that claim first."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        [row] = conn.execute(queries(schema).claim, {
            "effects": "{" + EFFECT + "}", "limit": 1, "lease": 30.0, "worker": "dead",
            "after": "{}"}).fetchall()
        assert row[2] == key
        if cancelled:
            done = _queue.on(conn, _queue.cancel(
                schema, row[0], _queue.Operator("a test", "command line")))
            assert done.changed
        conn.execute(sql.SQL("UPDATE {}.jobs SET lease_until = now() - interval '1 second' "
                             "WHERE key = %s").format(sql.Identifier(schema)), (key,))


def _run(flavour: str, dsn: str, schema: str, timeout: float = 60.0,
         **options: Any) -> outbox.DispatchStats:
    if flavour == "sync":
        return Dispatcher(dsn, [Unsure(schema)], schema=schema, rescue_interval=0.1,
                          **options).run_until_idle(timeout=timeout)
    return asyncio.run(AsyncDispatcher(dsn, [AsyncUnsure(schema)], schema=schema,
                                       rescue_interval=0.1, **options).run_until_idle(timeout))


def _hooked(dsn: str, schema: str) -> dict[str, str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(sql.SQL("SELECT key, error FROM {}.hooked").format(
            sql.Identifier(schema))).fetchall()
    return dict(rows)


def _delays(dsn: str, schema: str) -> dict[str, timedelta]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(sql.SQL("SELECT key, available_at - updated_at FROM {}.jobs")
                            .format(sql.Identifier(schema))).fetchall()
    return dict(rows)


FLAVOURS = ["sync", "async"]


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_an_expired_lease_with_attempts_used_up_ends_as_an_unknown_outcome_does(
    dsn: str, schema: str, flavour: str,
) -> None:
    _prepare(dsn, schema)
    _enqueue(dsn, schema, "expired", max_attempts=1)
    _claimed_by_a_dead_worker(dsn, schema, "expired")
    _enqueue(dsn, schema, "raised", max_attempts=1)
    stats = _run(flavour, dsn, schema)
    assert (stats.rescued, stats.reconcile) == (1, 1)  # the perform's, and the rescue's
    found = jobs(dsn, schema)
    for key in ("expired", "raised"):  # the same end: reconcile, the provider may have acted
        assert (found[key]["status"], found[key]["attempts"]) == ("reconcile", 1)
        assert found[key]["last_error"].startswith("UnknownOutcome: ")
        assert found[key]["last_error"].endswith("(attempts exhausted)")
    assert "lease expired on attempt 1 of 1 (worker dead stopped heartbeating)" in (
        found["expired"]["last_error"])
    assert _hooked(dsn, schema) == {}  # nothing failed: no on_failed, for either


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_an_expired_lease_with_attempts_left_is_retried_after_the_backoff(
    dsn: str, schema: str, flavour: str,
) -> None:
    _prepare(dsn, schema)
    _enqueue(dsn, schema, "expired", max_attempts=3)
    _claimed_by_a_dead_worker(dsn, schema, "expired")
    _enqueue(dsn, schema, "raised", max_attempts=3)
    # run_until_idle would wait for the job it rescued to retry: its timeout ends it first.
    stats = _run(flavour, dsn, schema, timeout=2.0, backoff=TenMinutes())
    assert (stats.rescued, stats.retried) == (1, 1)
    found, delays = jobs(dsn, schema), _delays(dsn, schema)
    for key in ("expired", "raised"):  # both pending, both after the backoff (not at once)
        assert (found[key]["status"], found[key]["attempts"]) == ("pending", 1)
        assert timedelta(seconds=599) < delays[key] <= timedelta(seconds=600)
    assert found["expired"]["last_error"].startswith(
        "UnknownOutcome: lease expired on attempt 1 of 3")


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_an_expired_claim_an_operator_cancelled_ends_failed_with_its_hook(
    dsn: str, schema: str, flavour: str,
) -> None:
    _prepare(dsn, schema)
    _enqueue(dsn, schema, "cancelled", max_attempts=3)
    _claimed_by_a_dead_worker(dsn, schema, "cancelled", cancelled=True)
    _enqueue(dsn, schema, "broken", max_attempts=3, payload={"hook": "raise"})
    _claimed_by_a_dead_worker(dsn, schema, "broken", cancelled=True)
    stats = _run(flavour, dsn, schema)
    assert stats.rescued == 2
    found = jobs(dsn, schema)
    for key in ("cancelled", "broken"):
        assert found[key]["status"] == "failed"
        assert found[key]["last_error"].startswith("cancelled by an operator while running")
    # on_failed ran in the transaction of the fenced write, told of the unknown outcome;
    # the hook that raised left nothing, and the cancelled job stayed failed.
    hooked = _hooked(dsn, schema)
    assert list(hooked) == ["cancelled"]
    assert hooked["cancelled"].startswith("UnknownOutcome: lease expired on attempt 1 of 3")
    assert "on_failed raised RuntimeError: the hook broke" in found["broken"]["last_error"]


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_rescue_cancelled_after_its_decision_is_reported_as_written(
    dsn: str, schema: str, flavour: str, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An operator cancels the claim after the rescue read it and decided a retry, before
    the write: ``settle`` writes it failed, and the rescuer says so (and does not wait for
    a retry that will never come)."""
    _prepare(dsn, schema)
    _enqueue(dsn, schema, "raced", max_attempts=3)
    _claimed_by_a_dead_worker(dsn, schema, "raced")
    real = outbox._lifecycle.expired
    decided: list[str] = []

    def expired(*args: Any, **kwargs: Any) -> outbox._lifecycle.Decision:
        decision = real(*args, **kwargs)
        decided.append(decision.status)
        with psycopg.connect(dsn, autocommit=True) as conn:
            [[job_id]] = conn.execute(sql.SQL("SELECT id FROM {}.jobs WHERE key = 'raced'")
                                      .format(sql.Identifier(schema))).fetchall()
            done = _queue.on(conn, _queue.cancel(
                schema, job_id, _queue.Operator("a test", "command line")))
            assert done.changed
        return decision

    monkeypatch.setattr(outbox._lifecycle, "expired", expired)
    caplog.set_level("WARNING", logger="outbox.dispatcher")
    stats = _run(flavour, dsn, schema)
    assert decided == ["pending"]  # the rescue decided a retry
    assert stats.rescued == 1
    found = jobs(dsn, schema)["raced"]
    assert found["status"] == "failed"  # the cancel's decision was written
    assert found["last_error"].startswith("cancelled by an operator")
    rescued = [r.getMessage() for r in caplog.records if "after its lease expired" in
               r.getMessage()]
    assert len(rescued) == 1 and rescued[0].endswith("now failed"), rescued
