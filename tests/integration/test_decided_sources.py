"""The transitions that no outcome of a perform settles (an operator's action, an answer of
the reconciler, a parent's settlement) write what the lifecycle decides for the job as it
was read: for each, the row before, the decision of ``outbox._lifecycle`` for that row,
and the row after must agree in every field the decision names. And the write is fenced
on the row as read: a job that moved on between the read and the write is left as it is,
and the operator is told so.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from psycopg import sql

import outbox
from outbox import (
    DispatchStats,
    Effect,
    Job,
    NewJob,
    NotPerformed,
    Performed,
    _after,
    _lifecycle,
    _queue,
)
from outbox._dispatch.hooked import in_transaction
from outbox._dispatch.reconciler import Reconciler
from outbox._dispatch.state import SharedState
from outbox._lifecycle import NEVER, Decision
from outbox._steps import Statement, execute, run
from outbox.cli import main

from .helpers import table

OPERATOR = _queue.Operator("ada@example.com", "dashboard")
STATUSES = ("pending", "running", "done", "failed", "reconcile")
ACTIONS: tuple[_lifecycle.Action, ...] = ("retry", "cancel", "resolve_done", "resolve_failed")
MARK = "decided by the lifecycle"
# A child's available_at while it waits on its parents (fragment after_never).
AFTER_NEVER = datetime.fromisoformat("9999-01-01T00:00:00+00:00")


def _seed(conn: psycopg.Connection[Any], schema: str, key: str, status: str, **columns: Any,
          ) -> int:
    """A job of ``status`` with an error, three attempts spent and a first attempt an
    hour ago; ``columns`` override."""
    row = {"effect": "test.decided", "key": key, "status": status, "attempts": 3,
           "claim_version": 3, "last_error": f"error of {key}",
           "lease_until": None, "claimed_by": None, **columns}
    if status == "running":
        row["lease_until"] = row["lease_until"] or "2999-01-01T00:00:00Z"
        row["claimed_by"] = "host:1"
    found = conn.execute(sql.SQL(
        "INSERT INTO {} (effect, key, payload, fingerprint, status, attempts, claim_version,"
        " last_error, lease_until, claimed_by, first_attempted_at, max_attempts)"
        " VALUES (%(effect)s, %(key)s, '{{}}', 'seeded', %(status)s, %(attempts)s,"
        " %(claim_version)s, %(last_error)s, %(lease_until)s::timestamptz, %(claimed_by)s,"
        " now() - interval '1 hour', 5) RETURNING id").format(table(schema, "jobs")),
        row).fetchone()
    assert found is not None
    return int(found[0])


def _row(conn: psycopg.Connection[Any], schema: str, job_id: int) -> dict[str, Any]:
    cur = conn.execute(sql.SQL(
        "SELECT j.*, now() AS db_now, EXISTS (SELECT 1 FROM {} r WHERE r.key = j.key)"
        " AS in_ledger FROM {} j WHERE j.id = %s").format(
            table(schema, "effect_results"), table(schema, "jobs")), (job_id,))
    names = [d.name for d in cur.description or []]
    found = cur.fetchone()
    assert found is not None
    return dict(zip(names, found, strict=True))


def _applied(before: dict[str, Any], decision: Decision, after: dict[str, Any]) -> None:
    """``after`` is ``before`` with ``decision`` applied, field by field."""
    assert after["status"] == decision.status
    expected_attempts = before["attempts"] if decision.attempts is None else decision.attempts
    assert after["attempts"] == expected_attempts
    expected_error = (None if decision.clear_error
                      else decision.error if decision.error is not None
                      else before["last_error"])
    assert after["last_error"] == expected_error
    if decision.fresh_window:
        assert after["first_attempted_at"] is None
    else:
        assert after["first_attempted_at"] == before["first_attempted_at"]
    assert after["in_ledger"] == (decision.ledger or before["in_ledger"])
    if decision.stop:
        assert after["cancel_version"] == after["claim_version"]
    else:
        assert after["cancel_version"] == before["cancel_version"]
    if decision.waive_parents:
        assert after["after_waiting"] == 0
    if decision.status == "pending" and before["status"] != "pending":
        due = after["available_at"] - after["db_now"]
        assert timedelta(seconds=decision.delay - 1) <= due <= timedelta(
            seconds=decision.delay + 1)
    assert after["claim_version"] == before["claim_version"]  # an operator claims nothing


def _unchanged(before: dict[str, Any], after: dict[str, Any]) -> None:
    ignored = {"db_now"}
    assert {k: v for k, v in after.items() if k not in ignored} == \
        {k: v for k, v in before.items() if k not in ignored}


def _audit(conn: psycopg.Connection[Any], schema: str) -> list[tuple[str, int | None, int]]:
    rows = conn.execute(sql.SQL("SELECT action, job_id, affected FROM {} ORDER BY id").format(
        table(schema, "dashboard_audit"))).fetchall()
    return [(str(a), j, int(n)) for a, j, n in rows]


# -- an operator's action -------------------------------------------------------------------


def test_each_operator_action_on_each_status_writes_the_lifecycles_decision(
        dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        seeded = {(action, status): _seed(conn, schema, f"{action}-{status}", status)
                  for action in ACTIONS for status in STATUSES}
        for (action, status), job_id in seeded.items():
            before = _row(conn, schema, job_id)
            decision = _lifecycle.operator_action(
                action, before["status"], last_error=before["last_error"],
                actor=OPERATOR.actor, via=OPERATOR.via)
            step = (_queue.resolve(schema, job_id, OPERATOR,
                                   performed=action == "resolve_done")
                    if action.startswith("resolve")
                    else getattr(_queue, action)(schema, job_id, OPERATOR))
            with conn.transaction():
                done = _queue.on(conn, step)
            after = _row(conn, schema, job_id)
            where = f"{action} of a {status} job"
            if decision is None:
                assert (done.changed, done.moved, done.status) == (False, False, status), where
                _unchanged(before, after)
            else:
                assert (done.changed, done.status) == (True, decision.status), where
                _applied(before, decision, after)
        audited = _audit(conn, schema)
    # Every action audited once, also the refused ones (affected 0).
    assert sorted(audited) == sorted(
        (action, job_id, int(_lifecycle.operator_action(
            action, status, last_error=None, actor="a", via="b") is not None))
        for (action, status), job_id in seeded.items())


def test_an_operator_action_writes_what_the_lifecycle_decides_not_a_rule_of_its_own(
        dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # By the rules a retry of a failed job is pending now with attempts reset; told
    # something no rule decides, the statement writes that.
    told = Decision("pending", delay=3600.0, error=MARK, attempts=2)
    calls: list[tuple[Any, ...]] = []

    def decide(*args: Any, **kwargs: Any) -> Decision:
        calls.append((*args, kwargs))
        return told

    monkeypatch.setattr(_lifecycle, "operator_action", decide)
    with psycopg.connect(dsn, autocommit=True) as conn:
        job_id = _seed(conn, schema, "k", "failed")
        before = _row(conn, schema, job_id)
        with conn.transaction():
            assert _queue.on(conn, _queue.retry(schema, job_id, OPERATOR)).changed
        _applied(before, told, _row(conn, schema, job_id))
    assert calls == [("retry", "failed", {"last_error": "error of k",
                                          "actor": OPERATOR.actor, "via": OPERATOR.via})]


def test_a_bulk_retry_writes_the_lifecycles_decision_to_each_job(
        dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        ids = [_seed(conn, schema, f"k{i}", "failed") for i in range(3)]
        befores = [_row(conn, schema, i) for i in ids]
        with conn.transaction():
            retried = _queue.on(conn, _queue.bulk_retry(
                schema, _queue.Selection(effect="test.decided"), OPERATOR, cap=10))
        decision = _lifecycle.operator_action("retry", "failed", last_error=None,
                                              actor=OPERATOR.actor, via=OPERATOR.via)
        assert retried == 3 and decision is not None
        for job_id, before in zip(ids, befores, strict=True):
            _applied(before, decision, _row(conn, schema, job_id))


# -- the race: the job moves on between the read and the write ------------------------------


def _interleaved(conn: psycopg.Connection[Any], meanwhile: Callable[[], None],
                 ) -> Callable[[Statement], Any]:
    """Execute a step's statements on ``conn``, running ``meanwhile`` (on another
    connection) right after the first one, the read."""
    ran: list[Statement] = []

    def executor(statement: Statement) -> Any:
        rows = execute(conn, statement)
        if not ran:
            meanwhile()
        ran.append(statement)
        return rows

    return executor


def test_an_operator_action_on_a_job_whose_claim_version_moved_applies_nothing_and_says_so(
        dsn: str, schema: str) -> None:
    # A person resolves a job in reconcile as performed while the reconciler takes it
    # (claim_version + 1, the fence of its answer): the decision was made for the job
    # as read; the write finds it moved on and changes nothing (no ledger row either).
    with psycopg.connect(dsn, autocommit=True) as other, \
            psycopg.connect(dsn, autocommit=True) as conn:
        job_id = _seed(conn, schema, "k", "reconcile")
        read = _row(conn, schema, job_id)

        reconciler = _reconciler(dsn, schema, Answers())

        def reconciler_takes() -> None:
            taken = run(reconciler.take(), lambda s: execute(other, s))
            assert len(taken) == 1

        with conn.transaction():
            done = run(_queue.resolve(schema, job_id, OPERATOR, performed=True),
                       _interleaved(conn, reconciler_takes))
        after = _row(conn, schema, job_id)
        assert (done.changed, done.moved, done.status) == (False, True, "reconcile")
        assert after["claim_version"] == read["claim_version"] + 1  # the take's, only
        assert (after["status"], after["last_error"], after["in_ledger"]) == \
            ("reconcile", read["last_error"], False)
        assert _audit(conn, schema) == [("resolve_done", job_id, 0)]


def test_a_retry_of_a_job_claimed_in_between_applies_nothing_and_the_cli_says_so(
        dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # `outbox retry` of a failed job that another person retried and a dispatcher
    # claimed (running, a new claim_version) between the command's read and its write:
    # nothing is written, and the command says the job changed (not that a retry does
    # not apply to a running job).
    with psycopg.connect(dsn, autocommit=True) as other:
        job_id = _seed(other, schema, "k", "failed")
        before = _row(other, schema, job_id)

        def retried_and_claimed() -> None:
            other.execute(sql.SQL(
                "UPDATE {} SET status = 'running', claim_version = claim_version + 1,"
                " lease_until = now() + interval '1 hour', claimed_by = 'host:2'"
                " WHERE id = %s").format(table(schema, "jobs")), (job_id,))

        monkeypatch.setattr(_queue, "on", lambda conn, step: run(
            step, _interleaved(conn, retried_and_claimed)))
        result = CliRunner().invoke(main, ["retry", str(job_id), "--dsn", dsn,
                                           "--schema", schema, "--actor", "ada"])
        assert result.exit_code == 1, result.output
        assert f"job {job_id} changed while this ran (it is running now)" in result.output
        after = _row(other, schema, job_id)
        assert (after["status"], after["attempts"], after["last_error"]) == \
            ("running", before["attempts"], before["last_error"])
        assert _audit(other, schema) == [("retry", job_id, 0)]


def test_a_dashboard_action_on_a_job_it_saw_at_another_version_applies_nothing(
        dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        job_id = _seed(conn, schema, "k", "failed")
        before = _row(conn, schema, job_id)
        with conn.transaction():
            done = _queue.on(conn, _queue.retry(
                schema, job_id, OPERATOR, seen=_queue.Seen("failed", before["claim_version"] - 1)))
        assert (done.changed, done.moved, done.status) == (False, True, "failed")
        _unchanged(before, _row(conn, schema, job_id))


# -- a parent's settlement (fan-in) ----------------------------------------------------------


def _enqueue(dsn: str, schema: str, *items: NewJob) -> None:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue_many(list(items))


def _child(conn: psycopg.Connection[Any], schema: str, key: str) -> dict[str, Any]:
    [found] = conn.execute(sql.SQL("SELECT id FROM {} WHERE key = %s").format(
        table(schema, "jobs")), (key,)).fetchall()
    return _row(conn, schema, int(found[0]))


def _parent_applied(before: dict[str, Any], decision: Decision, after: dict[str, Any]) -> None:
    assert after["status"] == decision.status
    assert after["last_error"] == (decision.error if decision.status == "failed"
                                   else before["last_error"])
    if decision.status == "pending":
        if decision.delay == NEVER:
            assert after["available_at"] == AFTER_NEVER
        else:
            assert after["available_at"] <= after["db_now"]


@pytest.mark.parametrize("mode", ["fail", "run"])
def test_a_parents_settlement_writes_the_lifecycles_decision_to_each_child(
        dsn: str, schema: str, mode: _lifecycle.Mode) -> None:
    # Two parents (reconcile: a person settles them); children waiting on one or both.
    # Each settlement (resolved as performed: done; as not performed: failed, with an
    # error the children quote) must leave each child as parent_settled decides.
    for outcome in ("done", "failed"):
        p1, p2 = f"{outcome}-p1", f"{outcome}-p2"
        _enqueue(dsn, schema, NewJob("test.parent", p1, {}), NewJob("test.parent", p2, {}))
        _enqueue(dsn, schema,
                 NewJob("test.child", f"{outcome}-one", {}, after=[p1], after_failed=mode),
                 NewJob("test.child", f"{outcome}-both", {}, after=[p1, p2],
                        after_failed=mode))
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("UPDATE {} SET status = 'reconcile', last_error = %s"
                                 " WHERE key = %s").format(table(schema, "jobs")),
                         ("UnknownOutcome: lost " + "x" * 300, p1))
            parent = _child(conn, schema, p1)
            children = {k: _child(conn, schema, f"{outcome}-{k}") for k in ("one", "both")}
            with conn.transaction():
                assert _queue.on(conn, _queue.resolve(
                    schema, parent["id"], OPERATOR, performed=outcome == "done")).changed
            settled = _child(conn, schema, p1)
            for name, before in children.items():
                failed = p1 if settled["status"] == "failed" else None
                decision = _lifecycle.parent_settled(
                    mode, before["after_waiting"], failed, settled["last_error"])
                _parent_applied(before, decision, _child(conn, schema, f"{outcome}-{name}"))


@pytest.mark.parametrize("mode", ["fail", "run"])
def test_a_child_enqueued_after_settled_parents_is_linked_as_the_lifecycle_decides(
        dsn: str, schema: str, mode: _lifecycle.Mode) -> None:
    _enqueue(dsn, schema, NewJob("test.parent", "failed-p", {}),
             NewJob("test.parent", "pending-p", {}))
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("UPDATE {} SET status = 'failed', last_error = 'Permanent: no'"
                             " WHERE key = 'failed-p'").format(table(schema, "jobs")))
    cases = {"c-failed": ["failed-p"], "c-failed-pending": ["failed-p", "pending-p"],
             "c-pending": ["pending-p"]}
    for key, parents in cases.items():
        _enqueue(dsn, schema, NewJob("test.child", key, {}, after=parents, after_failed=mode))
    with psycopg.connect(dsn, autocommit=True) as conn:
        for key, parents in cases.items():
            failed = "failed-p" if "failed-p" in parents else None
            decision = _lifecycle.parent_settled(
                mode, len(parents), failed, "Permanent: no" if failed else None,
                settled=int(failed is not None))
            _parent_applied({"last_error": None}, decision, _child(conn, schema, key))


# -- the reconciler's answers ----------------------------------------------------------------


class Answers(Effect):
    """Reconciles each job with the reply its key names."""

    name = "test.decided"

    def __init__(self) -> None:
        self.replies: dict[str, Any] = {}

    def perform(self, job: Job) -> None:
        raise AssertionError("not performed in this test")

    def reconcile(self, job: Job) -> Any:
        reply = self.replies[job.key]
        if isinstance(reply, BaseException):
            raise reply
        return reply


def _reconciler(dsn: str, schema: str, effect: Effect) -> Reconciler:
    settings = outbox.Dispatcher(dsn, [effect], schema=schema).settings
    return Reconciler(settings, SharedState(DispatchStats(), settings.observer, 1,
                                            threading.Event))


def test_each_answer_of_the_reconciler_writes_the_lifecycles_decision(
        dsn: str, schema: str) -> None:
    effect = Answers()
    effect.replies = {"performed": Performed({"id": 1}), "not-performed": NotPerformed(),
                      "cancelled": NotPerformed(), "failed": outbox.Permanent("refused"),
                      "unknown": None}
    reconciler = _reconciler(dsn, schema, effect)
    with psycopg.connect(dsn, autocommit=True) as conn:
        ids = {key: _seed(conn, schema, key, "reconcile") for key in effect.replies}
        conn.execute(sql.SQL("UPDATE {} SET cancel_version = claim_version WHERE id = %s")
                     .format(table(schema, "jobs")), (ids["cancelled"],))
        taken = run(reconciler.take(), lambda s: execute(conn, s))
        assert {job.key for job, _ in taken} == set(ids)
        for job, checks in taken:
            before = _row(conn, schema, job.id)
            answer = reconciler.ask(job, checks)
            rng_state = reconciler.rng.getstate()
            with conn.transaction():
                run(reconciler.resolve(answer), in_transaction(conn, schema))
            reconciler.rng.setstate(rng_state)  # the same draw as the resolve's
            decision = _lifecycle.settle_answer(
                answer.kind, error=answer.error, checks=checks,
                interval=reconciler.settings.reconcile_interval, rng=reconciler.rng,
                cancelled=job.key == "cancelled")
            after = _row(conn, schema, job.id)
            assert after["status"] == decision.status, job.key
            if decision.status == "reconcile":  # asked again after the decided delay
                assert after["last_error"] == (decision.error or before["last_error"])
                due = after["reconcile_at"] - after["db_now"]
                assert abs(due.total_seconds() - decision.delay) < 1, job.key
            else:
                _applied(before, decision, after)


def test_the_answer_not_performed_writes_what_the_lifecycle_decides(
        dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # By the rules "not performed" sends a job nobody cancelled back to pending; told
    # failed, the statement writes failed (the status is the decision's, not its own).
    told = Decision("failed", error=MARK, attempts=0, fresh_window=True)
    calls: list[dict[str, Any]] = []

    def decide(*args: Any, **kwargs: Any) -> Decision:
        calls.append(kwargs)
        return told

    effect = Answers()
    effect.replies = {"k": NotPerformed()}
    reconciler = _reconciler(dsn, schema, effect)
    with psycopg.connect(dsn, autocommit=True) as conn:
        job_id = _seed(conn, schema, "k", "reconcile")
        [(job, checks)] = run(reconciler.take(), lambda s: execute(conn, s))
        before = _row(conn, schema, job_id)
        monkeypatch.setattr(_lifecycle, "settle_answer", decide)
        with conn.transaction():
            run(reconciler.resolve(reconciler.ask(job, checks)), in_transaction(conn, schema))
        _applied(before, told, _row(conn, schema, job_id))
    assert calls == [{"cancelled": False}]


def test_a_cancelled_job_the_provider_has_no_trace_of_fails_its_children_at_once(
        dsn: str, schema: str) -> None:
    # An operator cancelled it while it ran; it went to reconcile, and the provider has
    # no trace: failed (never performed). Its children are settled in the same
    # statement, as parent_settled decides, not left for the sweep.
    effect = Answers()
    effect.replies = {"parent": NotPerformed()}
    reconciler = _reconciler(dsn, schema, effect)
    with psycopg.connect(dsn, autocommit=True) as conn:
        _seed(conn, schema, "parent", "reconcile")
        conn.execute(sql.SQL("UPDATE {} SET cancel_version = claim_version").format(
            table(schema, "jobs")))
    _enqueue(dsn, schema, NewJob("test.child", "child", {}, after=["parent"]))
    with psycopg.connect(dsn, autocommit=True) as conn:
        before = _child(conn, schema, "child")
        assert before["after_waiting"] == 1
        [(job, checks)] = run(reconciler.take(), lambda s: execute(conn, s))
        with conn.transaction():
            run(reconciler.resolve(reconciler.ask(job, checks)), in_transaction(conn, schema))
        parent = _child(conn, schema, "parent")
        assert parent["status"] == "failed"
        decision = _lifecycle.parent_settled("fail", 1, "parent", parent["last_error"])
        _parent_applied(before, decision, _child(conn, schema, "child"))


@pytest.mark.parametrize("mode", ["fail", "run"])
def test_the_sweep_settling_several_parents_at_once_writes_the_lifecycles_decision(
        dsn: str, schema: str, mode: _lifecycle.Mode) -> None:
    # Parents settled while their child's enqueue was still open (their settlements saw
    # no edge): the sweep resolves them, several parents of one child in one statement.
    # Children after: two done parents; a done and a failed one; two of three (one
    # still to come).
    parents = ("a-done", "b-done", "c-failed", "d-pending")
    _enqueue(dsn, schema, *(NewJob("test.parent", key, {}) for key in parents))
    cases = {"two-done": ["a-done", "b-done"], "done-failed": ["a-done", "c-failed"],
             "two-of-three": ["a-done", "c-failed", "d-pending"]}
    _enqueue(dsn, schema, *(NewJob("test.child", key, {}, after=after, after_failed=mode)
                            for key, after in cases.items()))
    with psycopg.connect(dsn, autocommit=True) as conn:
        jobs_table = table(schema, "jobs")
        # Settled behind the fan-in's back, as a settlement that could not see the edges.
        conn.execute(sql.SQL("UPDATE {} SET status = 'done' WHERE key IN ('a-done', 'b-done')")
                     .format(jobs_table))
        conn.execute(sql.SQL("UPDATE {} SET status = 'failed', last_error = 'Permanent: no'"
                             " WHERE key = 'c-failed'").format(jobs_table))
        befores = {key: _child(conn, schema, key) for key in cases}
        with conn.transaction():
            woken = run(_after.Sweep(schema).sweep(), lambda s: execute(conn, s))
        assert woken == len(cases)
        for key, after in cases.items():
            settled = [p for p in after if not p.endswith("-pending")]
            failed = min((p for p in settled if p.endswith("-failed")), default=None)
            decision = _lifecycle.parent_settled(
                mode, befores[key]["after_waiting"], failed,
                "Permanent: no" if failed else None, settled=len(settled))
            _parent_applied(befores[key], decision, _child(conn, schema, key))


@pytest.mark.parametrize("driver", ["psycopg", "psycopg2"])
def test_a_child_enqueued_through_sqlalchemy_is_linked_as_the_lifecycle_decides(
        dsn: str, schema: str, driver: str) -> None:
    # The link's two statements (the parents read, the decision written) through another
    # driver's connection: the same states as through psycopg.
    from sqlalchemy import create_engine

    from outbox.contrib.sqlalchemy import transaction as sqlalchemy_transaction

    _enqueue(dsn, schema, NewJob("test.parent", "failed-p", {}),
             NewJob("test.parent", "pending-p", {}))
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("UPDATE {} SET status = 'failed', last_error = 'Permanent: no'"
                             " WHERE key = 'failed-p'").format(table(schema, "jobs")))
    engine = create_engine(dsn.replace("postgresql://", f"postgresql+{driver}://", 1))
    try:
        with engine.begin() as target, sqlalchemy_transaction(target, schema=schema) as tx:
            tx.enqueue("test.child", key="fails", payload={}, after=["failed-p", "pending-p"])
            tx.enqueue("test.child", key="waits", payload={}, after=["pending-p"],
                       after_failed="run")
    finally:
        engine.dispose()
    with psycopg.connect(dsn, autocommit=True) as conn:
        _parent_applied({"last_error": None}, _lifecycle.parent_settled(
            "fail", 2, "failed-p", "Permanent: no", settled=1), _child(conn, schema, "fails"))
        _parent_applied({"last_error": None}, _lifecycle.parent_settled(
            "run", 1, None, settled=0), _child(conn, schema, "waits"))
