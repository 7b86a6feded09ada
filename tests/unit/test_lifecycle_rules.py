"""The pure lifecycle decisions, without a database."""

from __future__ import annotations

import random
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from outbox import Backoff, Job, Permanent, Retry, UnknownOutcome
from outbox._lifecycle import Decision, Rules, heartbeat_interval, seconds, settle

NOW = datetime(2026, 1, 1, tzinfo=UTC)
DAY = 86400.0


def _decide(error: BaseException, attempt: int = 1, max_attempts: int = 5,
            started: datetime | None = NOW, window: float = DAY) -> Decision:
    job = Job(id=1, effect="e", key="k", payload={}, attempt=attempt, claim_version=1,
              max_attempts=max_attempts, first_attempted_at=started)
    return settle(error, job, Rules(window=window, backoff=Backoff(base=1.0, cap=60.0)),
                  now=NOW, rng=random.Random(7))


def test_permanent_fails_at_once_with_reason() -> None:
    decision = _decide(Permanent("card declined: insufficient_funds"), attempt=1)
    assert decision.status == "failed"
    assert decision.error == "Permanent: card declined: insufficient_funds"


def test_retry_honours_after() -> None:
    assert _decide(Retry(after=12.5)) == Decision("pending", 12.5, "Retry: retry requested")


def test_retry_with_timedelta_after() -> None:
    assert _decide(Retry(after=timedelta(minutes=2))).delay == 120.0


@pytest.mark.parametrize(("signal", "delay"), [
    (Retry(12.5), 12.5), (Retry(30), 30.0), (Retry(timedelta(minutes=2)), 120.0),
])
def test_retry_takes_its_delay_positionally_as_the_contract_writes_it(
        signal: Retry, delay: float) -> None:
    # Retry(after=None) in the contract: Retry(30) is a delay of 30 s, not a reason "30"
    assert _decide(signal) == Decision("pending", delay, "Retry: retry requested")


def test_retry_of_none_positionally_backs_off_as_without_a_delay() -> None:
    # e.g. Retry(retry_after(response.headers)) where the header was absent
    decision = _decide(Retry(None), attempt=3, max_attempts=100)
    assert decision.status == "pending" and decision.error == "Retry: retry requested"
    assert 0.0 <= decision.delay <= 4.0


@pytest.mark.parametrize(("make", "message"), [
    (lambda: Retry(True), "a reason (a string) or a delay (seconds or a timedelta) first, "
                          "got bool"),
    (lambda: Retry([30]), "got list"),  # type: ignore[call-overload]
    (lambda: Retry(30, after=5), "a delay twice"),  # type: ignore[call-overload]
])
def test_retry_refuses_a_first_argument_it_cannot_read(make: Any, message: str) -> None:
    with pytest.raises(TypeError, match=re.escape(message)):
        make()


def test_retry_without_after_backs_off_within_the_exponential_bound() -> None:
    for attempt in range(1, 12):
        decision = _decide(Retry(), attempt=attempt, max_attempts=100)
        assert decision.status == "pending"
        assert 0.0 <= decision.delay <= min(60.0, 2.0 ** (attempt - 1))


def test_retry_past_max_attempts_fails_with_last_error() -> None:
    decision = _decide(Retry("provider 503"), attempt=5, max_attempts=5)
    assert decision.status == "failed"
    assert decision.error is not None and "provider 503" in decision.error
    assert "attempt 5 of 5" in decision.error


def test_other_exceptions_are_retried_like_retry() -> None:
    decision = _decide(ConnectionResetError("peer reset"), attempt=2)
    assert decision.status == "pending"
    assert decision.error == "ConnectionResetError: peer reset"


def test_other_exception_past_max_attempts_fails() -> None:
    assert _decide(KeyError("x"), attempt=3, max_attempts=3).status == "failed"


def test_unknown_outcome_is_retried_inside_the_window() -> None:
    decision = _decide(UnknownOutcome("timeout after send"), started=NOW - timedelta(hours=23))
    assert decision.status == "pending"


def test_unknown_outcome_past_the_window_needs_reconciling() -> None:
    decision = _decide(UnknownOutcome("timeout after send"), started=NOW - timedelta(hours=24))
    assert decision.status == "reconcile"
    assert decision.error is not None and "idempotency window" in decision.error


def test_unknown_outcome_with_attempts_exhausted_needs_reconciling_not_failing() -> None:
    decision = _decide(UnknownOutcome("dropped"), attempt=5, max_attempts=5)
    assert decision.status == "reconcile"


def test_error_text_is_bounded() -> None:
    decision = _decide(Permanent("x" * 10_000))
    assert decision.error is not None and len(decision.error) == 2000


def test_full_jitter_spreads_delays() -> None:
    rng = random.Random(1)
    delays = {round(Backoff(base=1.0, cap=100.0).delay(6, rng), 3) for _ in range(50)}
    assert len(delays) > 40
    assert max(delays) <= 32.0


def test_backoff_cap_holds_for_huge_attempt_numbers() -> None:
    assert Backoff(base=1.0, cap=5.0).delay(10_000, random.Random(0)) <= 5.0


def test_heartbeat_gives_three_chances_per_lease() -> None:
    assert heartbeat_interval(30.0) == 10.0


@pytest.mark.parametrize(("value", "expected"), [(1, 1.0), (2.5, 2.5),
                                                  (timedelta(seconds=3), 3.0)])
def test_seconds_accepts_numbers_and_timedeltas(value: float | timedelta, expected: float) -> None:
    assert seconds(value, what="lease", minimum=1.0) == expected


@pytest.mark.parametrize("value", [0.5, float("nan"), -1])
def test_seconds_rejects_too_small(value: float) -> None:
    with pytest.raises(ValueError, match="lease must be at least 1.0 seconds"):
        seconds(value, what="lease", minimum=1.0)


def test_retry_rejects_negative_after() -> None:
    with pytest.raises(ValueError, match="must not be negative"):
        Retry(after=-1)


@pytest.mark.parametrize(("options", "message"), [
    ({"base": 1e300}, "Backoff base must be seconds from 0 to a year (31536000), got 1e+300"),
    ({"cap": float("nan")}, "Backoff cap must be seconds from 0 to a year (31536000), got nan"),
    ({"base": -1}, "got -1"),
    ({"cap": "5"}, "got '5'"),
])
def test_a_backoff_past_a_year_or_not_a_number_is_refused_when_made(
        options: dict[str, Any], message: str) -> None:
    # else the first retry's time left PostgreSQL's calendar and its settlement failed
    with pytest.raises(ValueError, match=re.escape(message)):
        Backoff(**options)
