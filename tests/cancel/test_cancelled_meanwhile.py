"""A claim an operator cancels after its outcome was decided, before that was written.

The recorder decides (``_lifecycle.settle``) a retry; an operator then cancels the claim,
through the real operator path on another connection, before the settling statement runs.
The statement writes what the lifecycle decided for that case up front
(``_lifecycle.cancelled_meanwhile``), field by field, and a replaced lifecycle decision is
written as replaced: the statement has no rule of its own about a cancelled claim.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg import sql

import outbox
from outbox import Dispatcher, Effect, Job, NewJob, Retry, _lifecycle, _queue
from outbox._dispatch.settling import settle_claim, settle_claims
from outbox._lifecycle import Decision
from outbox.sql import queries

from ..integration.helpers import table

MARK = "decided by the lifecycle for a cancelled claim"
COLUMNS = ("id", "status", "attempts", "last_error", "available_at", "updated_at",
           "lease_until", "claimed_by", "claim_version", "cancel_version")


class RetriesLater(Effect):
    """Raises Retry an hour out: not cancelled, the job would wait, pending, that long."""

    name = "test.retries_later"

    def perform(self, job: Job) -> None:
        raise Retry("not yet", after=3600)


def _row(conn: psycopg.Connection[Any], schema: str, key: str) -> dict[str, Any]:
    cur = conn.execute(sql.SQL("SELECT {} FROM {} WHERE key = %s").format(
        sql.SQL(", ").join(map(sql.Identifier, COLUMNS)), table(schema, "jobs")), (key,))
    found = cur.fetchone()
    assert found is not None
    return dict(zip(COLUMNS, found, strict=True))


def _cancel(dsn: str, schema: str, key: str) -> dict[str, Any]:
    """The operator's cancel (``outbox cancel``'s path) of the running job ``key``, on a
    connection of its own; the row as it was just after."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET lock_timeout = '60s'")  # a lock held by the recorder: fail, not hang
        row = _row(conn, schema, key)
        assert row["status"] == "running"
        assert _queue.on(conn, _queue.cancel(
            schema, row["id"], _queue.Operator("a test", "command line"))).changed
        return _row(conn, schema, key)


def _cancelled_after_deciding(dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch,
                              ) -> tuple[list[Decision], list[dict[str, Any]]]:
    """``_lifecycle.settle`` replaced by the real one that, once it decided, has the job
    cancelled by an operator: what it decided, and the row just after the cancel."""
    real = _lifecycle.settle
    decided: list[Decision] = []
    at_cancel: list[dict[str, Any]] = []

    def settle(*args: Any, **kwargs: Any) -> Decision:
        assert kwargs.get("told") is None  # the perform ended before the cancel
        decision = real(*args, **kwargs)
        decided.append(decision)
        at_cancel.append(_cancel(dsn, schema, "k"))
        return decision

    monkeypatch.setattr(_lifecycle, "settle", settle)
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue_many([NewJob(RetriesLater.name, "k", {}, max_attempts=5)])
    return decided, at_cancel


def test_a_retry_decided_before_an_operators_cancel_is_written_as_the_lifecycle_decides(
    dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    decided, at_cancel = _cancelled_after_deciding(dsn, schema, monkeypatch)
    Dispatcher(dsn, [RetriesLater()], schema=schema).run_until_idle(timeout=60)
    [decision], [before] = decided, at_cancel
    assert decision.status == "pending" and decision.delay == 3600  # a retry, decided
    assert before["cancel_version"] == before["claim_version"]  # this claim, cancelled
    expected = _lifecycle.cancelled_meanwhile(decision)
    assert expected.status == "failed"
    with psycopg.connect(dsn, autocommit=True) as conn:
        after = _row(conn, schema, "k")
    assert after["status"] == expected.status
    assert after["last_error"] == expected.error
    assert after["last_error"] == "cancelled by an operator while running: Retry: not yet"
    assert after["attempts"] == before["attempts"] == 1  # the attempt spent, not refunded
    assert after["available_at"] == before["available_at"]  # failed: not made due again
    assert (after["lease_until"], after["claimed_by"]) == (None, None)
    assert after["claim_version"] == before["claim_version"]


def test_the_statement_writes_the_lifecycles_decision_for_a_cancelled_claim_whatever_it_is(
    dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A decision the real rule never takes (a cancelled claim back to pending, two hours
    # out): written as is, so the statement decides nothing of its own.
    asked: list[tuple[Decision, bool]] = []

    def cancelled_meanwhile(decision: Decision, *, released: bool = False) -> Decision:
        asked.append((decision, released))
        return Decision("pending", delay=7200.0, error=MARK)

    monkeypatch.setattr(_lifecycle, "cancelled_meanwhile", cancelled_meanwhile)
    decided, at_cancel = _cancelled_after_deciding(dsn, schema, monkeypatch)
    Dispatcher(dsn, [RetriesLater()], schema=schema).run_until_idle(timeout=60)
    [decision], [before] = decided, at_cancel
    assert asked == [(decision, False)]  # asked once, about the decision the recorder took
    assert before["cancel_version"] == before["claim_version"]
    with psycopg.connect(dsn, autocommit=True) as conn:
        after = _row(conn, schema, "k")
    assert (after["status"], after["last_error"]) == ("pending", MARK)
    assert (after["available_at"] - after["updated_at"]).total_seconds() == 7200.0
    assert after["attempts"] == 1


def test_a_release_of_a_claim_an_operator_cancelled_is_written_as_never_performed(
    dsn: str, schema: str,
) -> None:
    # The settling statement on its own: a release (attempt refunded) of a claim an
    # operator cancelled after it was decided, and one of a claim nobody cancelled.
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue_many([NewJob(RetriesLater.name, k, {}) for k in ("cancelled", "kept")])
    with psycopg.connect(dsn, autocommit=True) as conn:
        claimed = conn.execute(queries(schema).claim, {
            "effects": [RetriesLater.name], "limit": 2, "lease": 300.0, "worker": "w",
            "after": "{}"}).fetchall()
        assert len(claimed) == 2
        rows = {key: _row(conn, schema, key) for key in ("cancelled", "kept")}
    before = _cancel(dsn, schema, "cancelled")
    released = Decision("pending")
    jobs = {key: Job(id=row["id"], effect=RetriesLater.name, key=key, payload={},
                     attempt=row["attempts"], claim_version=row["claim_version"])
            for key, row in rows.items()}
    with psycopg.connect(dsn, autocommit=True) as conn:
        written = conn.execute(queries(schema).settle, {"claims": settle_claims(
            settle_claim(job, released, refund=True) for job in jobs.values())}).fetchall()
        assert sorted(r[0] for r in written) == sorted(j.id for j in jobs.values())
        after = {key: _row(conn, schema, key) for key in jobs}
    expected = _lifecycle.cancelled_meanwhile(released, released=True)
    assert (after["cancelled"]["status"], after["cancelled"]["last_error"]) == (
        expected.status, expected.error) == (
        "failed", "cancelled by an operator before it started: never performed")
    assert after["cancelled"]["attempts"] == before["attempts"] - 1 == 0  # refunded
    assert after["cancelled"]["available_at"] == before["available_at"]
    assert (after["kept"]["status"], after["kept"]["last_error"]) == ("pending", None)
    assert after["kept"]["attempts"] == 0
    assert after["kept"]["available_at"] == after["kept"]["updated_at"]  # due now


class HookRaises(Effect):
    """Fails for good; its on_failed raises, so the failure is retried (``settle`` with
    ``hook_error``) on the completion hooks' path."""

    name = "test.hook_raises"

    def perform(self, job: Job) -> None:
        raise outbox.Permanent("declined")

    def on_failed(self, tx: Any, job: Job, error: BaseException) -> None:
        raise RuntimeError("hook down")


def test_a_hooks_retry_decided_before_an_operators_cancel_is_written_as_the_lifecycle_decides(
    dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = _lifecycle.settle
    decided: list[Decision] = []
    at_cancel: list[dict[str, Any]] = []

    def settle(*args: Any, **kwargs: Any) -> Decision:
        decision = real(*args, **kwargs)
        if kwargs.get("hook_error") is not None:  # the hook raised: decided, then cancelled
            decided.append(decision)
            at_cancel.append(_cancel(dsn, schema, "k"))
        return decision

    monkeypatch.setattr(_lifecycle, "settle", settle)
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue_many([NewJob(HookRaises.name, "k", {}, max_attempts=5)])
    Dispatcher(dsn, [HookRaises()], schema=schema).run_until_idle(timeout=60)
    [decision], [before] = decided, at_cancel
    assert decision.status == "pending"  # the hook's failure retried, decided
    assert before["cancel_version"] == before["claim_version"]
    expected = _lifecycle.cancelled_meanwhile(decision)
    with psycopg.connect(dsn, autocommit=True) as conn:
        after = _row(conn, schema, "k")
    assert (after["status"], after["last_error"]) == (expected.status, expected.error) == (
        "failed", "cancelled by an operator while running: Permanent: declined; on_failed "
        "raised RuntimeError: hook down")
    assert after["attempts"] == before["attempts"] == 1
    assert after["available_at"] == before["available_at"]
    assert (after["lease_until"], after["claimed_by"]) == (None, None)
