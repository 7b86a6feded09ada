"""Properties of the decisions no perform's outcome settles (``outbox._lifecycle``): an
operator's action (``operator_action``), a parent's settlement (``parent_settled``) and
the reconciler's answer of "not performed" (``settle_answer``), without a database; and
that each decision is a transition ``TRANSITIONS`` lists (so the docs' table, tested
against it, lists it too)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from outbox._lifecycle import (
    ACTS_ON,
    NEVER,
    TRANSITIONS,
    Action,
    Mode,
    operator_action,
    parent_settled,
    settle_answer,
)

FAST = settings(max_examples=400, deadline=None, database=None)

statuses = st.sampled_from(["pending", "running", "done", "failed", "reconcile"])
actions = st.sampled_from(list(ACTS_ON))
errors = st.none() | st.text(max_size=300)
names = st.text(min_size=1, max_size=40)
modes = st.sampled_from(["fail", "run"])
keys = st.text(min_size=1, max_size=60)


def _listed(source: set[str], before: str, after: str) -> bool:
    return any(t.source in source and t.before == before and t.after == after
               for t in TRANSITIONS)


@FAST
@given(action=actions, status=statuses, last_error=errors, actor=names, via=names)
def test_an_operator_action_applies_to_its_statuses_only_and_is_a_listed_transition(
        action: Action, status: str, last_error: str | None, actor: str, via: str) -> None:
    decision = operator_action(action, status, last_error=last_error, actor=actor, via=via)
    assert (decision is None) == (status not in ACTS_ON[action])
    if decision is None:
        return
    if decision.status == status:  # no status change: a running job's claim told to stop
        assert (action, status, decision.stop) == ("cancel", "running", True)
        return
    assert not decision.stop
    assert _listed({"operator", "cancel"}, status, decision.status)


@FAST
@given(status=st.sampled_from(["failed", "reconcile"]), last_error=errors, actor=names,
       via=names)
def test_a_retry_is_a_fresh_start_now_with_the_error_kept(
        status: str, last_error: str | None, actor: str, via: str) -> None:
    decision = operator_action("retry", status, last_error=last_error, actor=actor, via=via)
    assert decision is not None
    assert (decision.status, decision.delay, decision.attempts) == ("pending", 0.0, 0)
    assert decision.fresh_window and decision.waive_parents
    assert decision.error is None and not decision.clear_error and not decision.ledger


@FAST
@given(last_error=errors, actor=names, via=names)
def test_a_resolution_names_the_person_and_only_performed_writes_the_ledger(
        last_error: str | None, actor: str, via: str) -> None:
    done = operator_action("resolve_done", "reconcile", last_error=last_error, actor=actor,
                           via=via)
    failed = operator_action("resolve_failed", "reconcile", last_error=last_error,
                             actor=actor, via=via)
    assert done is not None and failed is not None
    assert (done.status, done.ledger, done.clear_error) == ("done", True, True)
    assert (failed.status, failed.ledger) == ("failed", False)
    assert failed.error is not None and actor in failed.error
    if last_error is not None:  # what the job said before is kept after the person
        assert failed.error.endswith(last_error)
    cancelled = operator_action("cancel", "pending", last_error=last_error, actor=actor,
                                via=via)
    assert cancelled is not None and cancelled.status == "failed"
    assert cancelled.error == f"cancelled from the {via} by {actor}"


@FAST
@given(mode=modes, waiting=st.integers(min_value=1, max_value=50),
       settled=st.integers(min_value=1, max_value=50), failed=st.none() | keys,
       error=errors)
def test_a_parents_settlement_fails_releases_or_keeps_the_child_waiting(
        mode: Mode, waiting: int, settled: int, failed: str | None,
        error: str | None) -> None:
    decision = parent_settled(mode, waiting, failed, error, settled=settled)
    if failed is not None and mode == "fail":
        assert decision.status == "failed" and decision.error is not None
        assert decision.error.startswith(f"not performed: parent {failed} failed for good")
        # the parent's error quoted, shortened
        assert len(decision.error) <= len(f"not performed: parent {failed} failed for "
                                          "good") + 200 + 3
        assert _listed({"parent"}, "pending", "failed")
        return
    assert decision.status == "pending" and decision.error is None
    assert decision.delay == (0.0 if settled >= waiting else NEVER)


@FAST
@given(cancelled=st.booleans())
def test_not_performed_is_a_fresh_start_unless_an_operator_cancelled_it(
        cancelled: bool) -> None:
    decision = settle_answer("not_performed", cancelled=cancelled)
    assert decision.status == ("failed" if cancelled else "pending")
    assert decision.attempts == 0 and decision.fresh_window and not decision.ledger
    assert _listed({"reconcile"}, "reconcile", decision.status)
