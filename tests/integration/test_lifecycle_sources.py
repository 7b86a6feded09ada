"""Each source of a transition that weighs an outcome applies what the lifecycle decides.

For each (the recorder settling an attempt, a completion hook that raised, the rescuer, an
operator's cancel told to a running perform, the reconciler), the lifecycle's function is
replaced by one that decides something the real rules never would for that case (a
marked error, a status, a delay); the job must end exactly as decided: the source wrote
the decision, it did not decide on its own. The tables of ``tests/unit/test_transitions``
check the real decisions.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

import outbox
from outbox import Dispatcher, Effect, Job, NewJob, _lifecycle, _queue
from outbox._lifecycle import Decision
from outbox.sql import queries
from outbox.testing import jobs

from .helpers import wait_until

MARK = "decided by the lifecycle"


def _enqueue(dsn: str, schema: str, effect: str, key: str, **options: Any) -> None:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue_many([NewJob(effect, key, {}, **options)])


def _decides(monkeypatch: pytest.MonkeyPatch, name: str, decision: Decision,
             ) -> list[dict[str, Any]]:
    """Replace ``_lifecycle.<name>`` by one returning ``decision``; its calls' keywords."""
    calls: list[dict[str, Any]] = []

    def decide(*args: Any, **kwargs: Any) -> Decision:
        calls.append(kwargs)
        return decision

    monkeypatch.setattr(_lifecycle, name, decide)
    return calls


class Raises(Effect):
    name = "test.raises"

    def perform(self, job: Job) -> None:
        raise RuntimeError("boom")


def test_the_recorder_writes_the_settlement_the_lifecycle_decides(
    dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A RuntimeError on the first of three attempts is a retry by the rules: told reconcile.
    calls = _decides(monkeypatch, "settle", Decision("reconcile", error=MARK))
    _enqueue(dsn, schema, Raises.name, "k", max_attempts=3)
    Dispatcher(dsn, [Raises()], schema=schema).run_until_idle(timeout=60)
    job = jobs(dsn, schema)["k"]
    assert (job["status"], job["last_error"]) == ("reconcile", MARK)
    assert len(calls) == 1


class HookRaises(Effect):
    name = "test.hook_raises"

    def perform(self, job: Job) -> dict[str, int]:
        return {"n": 1}

    def on_done(self, tx: outbox.HookTransaction, job: Job, result: Any) -> None:
        raise RuntimeError("hook")


def test_a_hook_that_raised_is_settled_as_the_lifecycle_decides(
    dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # On the first of three attempts the rules retry: told failed (the result kept).
    calls = _decides(monkeypatch, "settle", Decision("failed", error=MARK))
    _enqueue(dsn, schema, HookRaises.name, "k", max_attempts=3)
    Dispatcher(dsn, [HookRaises()], schema=schema).run_until_idle(timeout=60)
    job = jobs(dsn, schema)["k"]
    assert (job["status"], job["last_error"]) == ("failed", MARK)
    assert calls and all(c.get("hook_error") is not None for c in calls)


class Quick(Effect):
    name = "test.quick"

    def perform(self, job: Job) -> dict[str, int]:
        return {"n": 1}


def test_the_rescuer_writes_the_decision_the_lifecycle_takes(
    dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Attempts left, inside the window: the rules retry; told failed.
    calls = _decides(monkeypatch, "expired", Decision("failed", error=MARK))
    _enqueue(dsn, schema, Quick.name, "k", max_attempts=5)
    with psycopg.connect(dsn, autocommit=True) as conn:  # a worker that claimed, then died
        conn.execute(queries(schema).claim, {"effects": "{test.quick}", "limit": 1,
                                             "lease": 30.0, "worker": "dead", "after": "{}"})
        conn.execute(sql.SQL("UPDATE {}.jobs SET lease_until = now() - interval '1 second'")
                     .format(sql.Identifier(schema)))
    stats = Dispatcher(dsn, [Quick()], schema=schema).run_until_idle(timeout=60)
    job = jobs(dsn, schema)["k"]
    assert (job["status"], job["last_error"]) == ("failed", MARK)
    assert stats.rescued == 1
    assert calls == [{"now": calls[0]["now"], "rng": calls[0]["rng"], "worker": "dead",
                      "cancelled": False}]


class Blocks(Effect):
    name = "test.blocks"

    def __init__(self) -> None:
        self.started = threading.Event()

    def perform(self, job: Job) -> None:
        self.started.set()
        assert job.cancelled.wait(60), "never told to stop"
        raise RuntimeError("stopped when told")


def test_an_operators_cancel_of_a_running_job_is_settled_by_the_lifecycle(
    dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    real: Callable[..., Decision] = _lifecycle.settle
    told: list[Any] = []

    def settle(*args: Any, **kwargs: Any) -> Decision:
        told.append(kwargs.get("told"))
        decision = real(*args, **kwargs)
        return Decision(decision.status, decision.delay, f"{MARK}: {decision.error}")

    monkeypatch.setattr(_lifecycle, "settle", settle)
    effect = Blocks()
    _enqueue(dsn, schema, Blocks.name, "k", max_attempts=3)
    dispatcher = Dispatcher(dsn, [effect], schema=schema, poll_interval=0.05)
    runner = threading.Thread(target=dispatcher.run)
    runner.start()
    try:
        assert effect.started.wait(60)
        with psycopg.connect(dsn, autocommit=True) as conn:
            [row] = conn.execute(sql.SQL("SELECT id FROM {}.jobs").format(
                sql.Identifier(schema))).fetchall()
            assert _queue.on(conn, _queue.cancel(
                schema, row[0], _queue.Operator("a test", "command line"))).changed
        wait_until(lambda: jobs(dsn, schema)["k"]["status"] != "running", 60,
                   "the cancelled job to settle")
    finally:
        dispatcher.stop()
        runner.join(60)
    job = jobs(dsn, schema)["k"]
    assert told == ["operator"]  # the recorder asked the lifecycle, told of the cancel
    assert job["status"] == "failed"
    assert job["last_error"].startswith(f"{MARK}: cancelled by an operator while running")


class Unknown(Effect):
    name = "test.unknown"

    def perform(self, job: Job) -> None:
        raise outbox.UnknownOutcome("lost the answer")

    def reconcile(self, job: Job) -> None:
        return None  # the provider does not know yet


def test_the_reconciler_writes_the_next_ask_the_lifecycle_decides(
    dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    _enqueue(dsn, schema, Unknown.name, "k", max_attempts=1)  # reconcile after one attempt
    Dispatcher(dsn, [Unknown()], schema=schema).run_until_idle(timeout=60)
    assert jobs(dsn, schema)["k"]["status"] == "reconcile"
    calls = _decides(monkeypatch, "settle_answer",
                     Decision("reconcile", delay=40 * 86400.0, error=MARK))
    Dispatcher(dsn, [Unknown()], schema=schema).run_until_idle(timeout=60)
    with psycopg.connect(dsn, autocommit=True) as conn:
        [(status, error, wait)] = conn.execute(sql.SQL(
            "SELECT status, last_error, reconcile_at - now() FROM {}.jobs").format(
                sql.Identifier(schema))).fetchall()
    assert (status, error) == ("reconcile", MARK)
    assert timedelta(days=39) < wait <= timedelta(days=40)  # past any delay of the rules
    assert len(calls) == 1
