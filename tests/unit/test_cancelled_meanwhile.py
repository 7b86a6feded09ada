"""``_lifecycle.cancelled_meanwhile``: the decision written instead of another when an
operator cancelled the claim after it was decided, before it was written."""

from __future__ import annotations

import random
from datetime import UTC, datetime

import pytest

from outbox import Job, Permanent, Retry, Throttled, UnknownOutcome, _lifecycle
from outbox._lifecycle import RELEASED, Decision, Rules

NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)


def _settle(outcome: BaseException | _lifecycle.Released, attempt: int = 1) -> Decision:
    job = Job(id=1, effect="e", key="k", payload={}, attempt=attempt, claim_version=attempt,
              max_attempts=3, first_attempted_at=NOW)
    return _lifecycle.settle(outcome, job, Rules(window=3600.0), now=NOW,
                             rng=random.Random(0))


@pytest.mark.parametrize("outcome", [Retry("again"), RuntimeError("boom"),
                                     UnknownOutcome("timeout"), Throttled(5.0)],
                         ids=type)
def test_a_decided_retry_becomes_failed_naming_the_cancel_and_the_error(
        outcome: BaseException) -> None:
    decision = _settle(outcome)
    assert decision.status == "pending"
    cancelled = _lifecycle.cancelled_meanwhile(decision)
    assert cancelled == Decision("failed", error="cancelled by an operator while running: "
                                                 f"{decision.error}")


def test_a_decided_retry_without_an_error_is_failed_with_the_cancel_alone() -> None:
    assert _lifecycle.cancelled_meanwhile(Decision("pending", delay=5.0)) == Decision(
        "failed", error="cancelled by an operator while running")


def test_a_release_is_failed_never_performed_as_after_told_says() -> None:
    decision = _settle(RELEASED)
    cancelled = _lifecycle.cancelled_meanwhile(decision, released=True)
    told = _lifecycle.after_told(RELEASED, "operator", Rules())
    assert cancelled == told == Decision(
        "failed", error="cancelled by an operator before it started: never performed")


@pytest.mark.parametrize("outcome,attempt", [(Permanent("no"), 1), (RuntimeError("x"), 3),
                                             (UnknownOutcome("lost"), 3)])
def test_a_decision_that_is_not_pending_stands(outcome: BaseException, attempt: int) -> None:
    decision = _settle(outcome, attempt)
    assert decision.status in ("failed", "reconcile")
    assert _lifecycle.cancelled_meanwhile(decision) is decision
