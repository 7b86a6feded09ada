"""The table of transitions (``outbox._lifecycle.TRANSITIONS``) against the three things it
describes: the docs' table, the SQL statements that write a status, and the lifecycle's
decisions (one case per transition a function of the module decides)."""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from importlib import resources
from pathlib import Path

import pytest

from outbox import Job, Permanent, Retry, UnknownOutcome, _lifecycle
from outbox._lifecycle import TRANSITIONS, Decision, Rules, Transition
from outbox._sql import CORE_FILES, core_fragments, parse_sql

DOC = Path(__file__).parents[2] / "docs" / "explanation" / "failure-windows.md"
NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)
# A statement writes a status when it sets one (alone, or first of a row of columns set
# from a subquery), or deletes jobs.
WRITES_STATUS = re.compile(
    r"(?:SET|,)\s+status\s*=|SET\s+\(status\s*,|DELETE\s+FROM\s+\{schema\}\.jobs")


def _row(transition: Transition) -> tuple[str, ...]:
    """A transition as the docs' table shows it."""
    decided = "SQL" if transition.decided_by == "SQL" else f"`{transition.decided_by}`"
    return (transition.source, transition.before, transition.after or "(deleted)",
            transition.when, decided, f"`{transition.statement}`")


def _doc_table() -> list[tuple[str, ...]]:
    """The rows of the docs' table of transitions (the one headed "source | from | to")."""
    lines = DOC.read_text("utf-8").splitlines()
    start = lines.index("| source | from | to | when | decided by | statement |")
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(tuple(cell.strip() for cell in line.strip().strip("|").split(" | ")))
    return rows


def test_the_docs_table_is_the_lifecycles_table() -> None:
    assert _doc_table() == [_row(t) for t in TRANSITIONS]


def _sql_blocks() -> dict[str, str]:
    blocks: dict[str, str] = {}
    for name in CORE_FILES:
        parsed = parse_sql(resources.files("outbox").joinpath(name).read_text("utf-8"))
        blocks.update(parsed.blocks)
        blocks.update(parsed.fragments)
    return blocks


def test_every_statement_that_writes_a_status_is_in_the_table_and_no_other() -> None:
    blocks = _sql_blocks()
    writing = {name for name, text in blocks.items() if WRITES_STATUS.search(text)}
    assert writing == {t.statement for t in TRANSITIONS}


# The statements whose status is the decision's, bound as a parameter (the operator's
# decisions: operator_apply, one statement for retry, cancel and both resolves, which
# were four statements until their decisions moved to the lifecycle; bulk_retry; and the
# reconciler's answer of "not performed", pending or failed; a child enqueued after its
# parents, decided by parent_settled).
DECISION_PARAMETER = {
    "operator_apply": r"SET status = %\(status\)s::text",
    "bulk_retry": r"SET status = %\(decided_status\)s::text",
    "reconcile_not_performed": r"SET status = CAST\(%\(status\)s AS text\)",
    "after_link": r"status = k\.status",  # parent_settled's, per child
}
# The fragments whose status is rendered from a rule of the lifecycle (the rule's table,
# outbox._rule_sql), by the fragment of the status they name.
RENDERED = {"after_released": "parent_status"}


@pytest.mark.parametrize("transition", TRANSITIONS, ids=lambda t: f"{t.statement}->{t.after}")
def test_each_statement_can_write_the_status_the_table_says(transition: Transition) -> None:
    text = _sql_blocks()[transition.statement]
    if transition.after is None:
        assert re.search(r"DELETE\s+FROM\s+\{schema\}\.jobs", text)
    elif transition.statement == "settle":  # the status is the claim's decision, a parameter
        assert re.search(r"SET\s+\(status\s*,", text)
        assert "->> 'status'" in text and "->> 'cancelled_status'" in text
    elif transition.statement in DECISION_PARAMETER:  # the decision's status, bound
        assert re.search(DECISION_PARAMETER[transition.statement], text)
    elif transition.statement in RENDERED:  # the rule's cases, rendered into the fragment
        fragment = RENDERED[transition.statement]
        assert f"status = {{{fragment}}}" in text
        assert f"'{transition.after}'" in core_fragments()[fragment]
    else:
        assert f"'{transition.after}'" in text
    if transition.decided_by != "SQL":
        assert callable(getattr(_lifecycle, transition.decided_by))


# -- the lifecycle decides each transition it is named for -----------------------------------


def _job(attempt: int = 1, max_attempts: int = 3, age: float = 10.0) -> Job:
    return Job(id=1, effect="e", key="k", payload={}, attempt=attempt, claim_version=attempt,
               max_attempts=max_attempts, first_attempted_at=NOW - timedelta(seconds=age))


def _settle(outcome: BaseException | None, job: Job | None = None, *,
            hook_error: BaseException | None = None, told: _lifecycle.Told | None = None,
            rules: Rules | None = None) -> Decision:
    return _lifecycle.settle(outcome, job or _job(), rules or Rules(window=3600.0), now=NOW,
                             rng=random.Random(0), hook_error=hook_error, told=told)


def _expired(job: Job, *, cancelled: bool = False) -> Decision:
    return _lifecycle.expired(job, Rules(window=3600.0), now=NOW, rng=random.Random(0),
                              worker="w", cancelled=cancelled)


CASES: dict[tuple[str, str | None, str], Callable[[], Decision]] = {
    ("complete", "done", "perform returned (+ ledger row)"): lambda: _settle(None),
    ("complete_delete", None, "perform returned, retention 0 (+ ledger row)"):
        lambda: _settle(None),
    ("settle", "pending", "Retry, an error or UnknownOutcome with attempts and window left "
     "(backoff); Throttled; released at a stop"): lambda: _settle(Retry("again")),
    ("settle", "failed", "Permanent, or attempts used up"): lambda: _settle(Permanent("no")),
    ("settle", "reconcile", "UnknownOutcome past the window or with attempts used up"):
        lambda: _settle(UnknownOutcome("timeout"), _job(attempt=3)),
    ("settle", "pending", "lease expired, attempts and window left (backoff)"):
        lambda: _expired(_job()),
    ("settle", "reconcile", "lease expired, attempts used up or past the window"):
        lambda: _expired(_job(attempt=3)),
    ("settle", "failed", "lease expired on a claim an operator cancelled"):
        lambda: _expired(_job(), cancelled=True),
    ("keep_result", "pending", "on_done raised, attempts left (the result kept)"):
        lambda: _settle(None, hook_error=RuntimeError("hook")),
    ("fail_performed", "failed", "on_done raised on the last attempt"):
        lambda: _settle(None, _job(attempt=3), hook_error=RuntimeError("hook")),
    ("reconcile_done", "done", "the provider acted (+ ledger row)"):
        lambda: _lifecycle.settle_answer("performed"),
    ("reconcile_keep", "pending", "the provider acted, on_done raised (the result kept)"):
        lambda: _lifecycle.settle_answer("performed", hook_error=RuntimeError("hook")),
    ("reconcile_not_performed", "pending", "the provider has no trace (a fresh window)"):
        lambda: _lifecycle.settle_answer("not_performed"),
    ("reconcile_fail", "failed", "reconcile raised Permanent"):
        lambda: _lifecycle.settle_answer("failed", error=Permanent("no")),
    ("settle", "failed", "cancelled while running: told to stop, its outcome then settled "
     "(reconcile for an effect that reconciles)"):
        lambda: _settle(RuntimeError("stopped"), told="operator"),
    ("settle", "failed", "cancelled after its outcome was decided a retry or a release, "
     "before that was written"):
        lambda: _lifecycle.cancelled_meanwhile(_settle(Retry("again"))),
    ("reconcile_not_performed", "failed", "no trace of a job an operator cancelled"):
        lambda: _lifecycle.settle_answer("not_performed", cancelled=True),
    ("operator_apply", "pending", "retry (attempts reset)"):
        lambda: _operator("retry", "failed"),
    ("bulk_retry", "pending", "retry of every failed job of a filter"):
        lambda: _operator("retry", "failed"),
    ("operator_apply", "done", "resolved: performed (+ ledger row)"):
        lambda: _operator("resolve_done", "reconcile"),
    ("operator_apply", "failed", "resolved: not performed"):
        lambda: _operator("resolve_failed", "reconcile"),
    ("operator_apply", "failed", "cancelled before it started"):
        lambda: _operator("cancel", "pending"),
    ("after_released", "failed", "a parent failed, the child says after_failed='fail'"):
        lambda: _lifecycle.parent_settled("fail", 2, "parent", "Permanent: no"),
    ("after_link", "failed", "enqueued after a parent that had failed, "
     "after_failed='fail'"):
        lambda: _lifecycle.parent_settled("fail", 1, "parent", None),
}


def _operator(action: _lifecycle.Action, status: str) -> Decision:
    decision = _lifecycle.operator_action(action, status, last_error="x", actor="ada",
                                          via="dashboard")
    assert decision is not None
    return decision


def test_every_transition_the_lifecycle_decides_has_a_case() -> None:
    decided = {(t.statement, t.after, t.when) for t in TRANSITIONS if t.decided_by != "SQL"}
    assert decided == set(CASES)


@pytest.mark.parametrize("key", list(CASES), ids=lambda k: f"{k[0]}->{k[1]}")
def test_the_lifecycle_decides_each_transition_it_is_named_for(
        key: tuple[str, str | None, str]) -> None:
    statement, after, _ = key
    decision = CASES[key]()
    # A completion deletes the row with retention 0: the decision is still "done".
    assert decision.status == (after or "done"), statement
