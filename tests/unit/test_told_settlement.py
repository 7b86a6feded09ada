"""What a perform told to stop settles as (``_lifecycle.settle(..., told=...)``), without a
database: one row of the table in docs/how-to/cancelling.md each."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest

import outbox
from outbox import Backoff, Permanent, Retry, Throttled, UnknownOutcome
from outbox._lifecycle import RELEASED, Decision, Released, Rules, Told, settle

NOW = datetime(2026, 1, 1, tzinfo=UTC)
RULES = Rules(backoff=Backoff(base=10.0, cap=10.0), window=3600.0)
RECONCILES = Rules(backoff=Backoff(base=10.0, cap=10.0), window=3600.0, reconciles=True)
OTHER_REASONS: tuple[Told, ...] = ("lost", "lease", "timeout", "stop")


def _job(attempt: int = 1, max_attempts: int = 5) -> outbox.Job:
    return outbox.Job(id=1, effect="payment.charge", key="k", payload={}, attempt=attempt,
                      claim_version=attempt, max_attempts=max_attempts,
                      first_attempted_at=NOW - timedelta(seconds=5))


def _settle(outcome: BaseException | Released | None, told: Told,
            rules: Rules = RULES, job: outbox.Job | None = None) -> Decision:
    return settle(outcome, job or _job(), rules, now=NOW, rng=random.Random(1), told=told)


@pytest.mark.parametrize("told", ["operator", *OTHER_REASONS])
def test_a_perform_that_returned_after_being_told_was_performed(told: Told) -> None:
    assert _settle(None, told).status == "done"


def test_an_operators_cancel_of_a_raising_perform_ends_failed_saying_it_may_have_acted(
) -> None:
    decision = _settle(RuntimeError("stopped"), "operator")
    assert decision.status == "failed"
    assert "cancelled by an operator while running" in (decision.error or "")
    assert "may have acted" in (decision.error or "")


def test_an_operators_cancel_of_an_effect_that_reconciles_asks_the_provider() -> None:
    decision = _settle(RuntimeError("stopped"), "operator", RECONCILES)
    assert decision.status == "reconcile"
    assert "asked whether it acted" in (decision.error or "")


def test_an_operators_cancel_before_the_perform_started_fails_it_never_performed() -> None:
    decision = _settle(RELEASED, "operator")
    assert decision.status == "failed"
    assert "never performed" in (decision.error or "")


@pytest.mark.parametrize("told", OTHER_REASONS)
def test_any_other_reason_makes_a_raising_perform_an_unknown_outcome(told: Told) -> None:
    decision = _settle(RuntimeError("connection reset"), told)
    # retried with the same key inside the window, with backoff, and says why
    assert decision.status == "pending"
    assert decision.delay is not None and decision.delay >= 0
    assert "told to stop" in (decision.error or "")


@pytest.mark.parametrize("told", OTHER_REASONS)
def test_past_its_attempts_a_told_perform_goes_to_reconcile_not_failed(told: Told) -> None:
    # it may have acted: an unknown outcome with its attempts used up is asked about
    decision = _settle(RuntimeError("boom"), told, job=_job(attempt=5, max_attempts=5))
    assert decision.status == "reconcile"


@pytest.mark.parametrize("told", OTHER_REASONS)
@pytest.mark.parametrize(("verdict", "status"), [
    (Permanent("card declined"), "failed"),
    (Retry(after=30.0), "pending"),
    (UnknownOutcome("timed out"), "pending"),
    (Throttled(after=1.0), "pending"),
])
def test_the_effects_own_verdict_stands_when_it_was_told_for_another_reason(
        told: Told, verdict: BaseException, status: str) -> None:
    assert _settle(verdict, told) == settle(verdict, _job(), RULES, now=NOW,
                                            rng=random.Random(1))
    assert _settle(verdict, told).status == status


@pytest.mark.parametrize("told", OTHER_REASONS)
def test_a_released_attempt_stays_released_for_any_other_reason(told: Told) -> None:
    decision = _settle(RELEASED, told)
    assert decision.status == "pending"
    assert decision.error is None
