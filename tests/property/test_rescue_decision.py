"""Properties of the rescuer's decision (``outbox._lifecycle.expired``), without a database:
an expired lease is an unknown outcome, settled exactly as ``settle`` settles one."""

from __future__ import annotations

import math
import random
from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from outbox import Backoff, Job, UnknownOutcome
from outbox._lifecycle import Rules, expired, lease_expired, settle

FAST = settings(max_examples=400, deadline=None, database=None)
NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)

seeds = st.integers(min_value=0, max_value=2**32)
windows = st.sampled_from([0.0, 60.0, 3600.0, 86400.0, math.inf])
ages = st.floats(min_value=0.0, max_value=3 * 86400.0, allow_nan=False)
backoffs = st.builds(Backoff, base=st.floats(min_value=0.0, max_value=600.0),
                     cap=st.floats(min_value=0.0, max_value=7200.0))
workers = st.none() | st.text(min_size=1, max_size=20)


@st.composite
def leased_jobs(draw: st.DrawFn) -> Job:
    max_attempts = draw(st.integers(min_value=1, max_value=30))
    attempt = draw(st.integers(min_value=1, max_value=max_attempts))
    age = draw(ages)
    return Job(id=1, effect="e", key="k", payload={}, attempt=attempt, claim_version=attempt,
               max_attempts=max_attempts, first_attempted_at=NOW - timedelta(seconds=age))


@FAST
@given(job=leased_jobs(), window=windows, backoff=backoffs, reconciles=st.booleans(),
       cancelled=st.booleans(), worker=workers, seed=seeds)
def test_an_expired_lease_settles_exactly_as_an_unknown_outcome(
    job: Job, window: float, backoff: Backoff, reconciles: bool, cancelled: bool,
    worker: str | None, seed: int,
) -> None:
    rules = Rules(window=window, backoff=backoff, reconciles=reconciles)
    rescued = expired(job, rules, now=NOW, rng=random.Random(seed), worker=worker,
                      cancelled=cancelled)
    performed = settle(lease_expired(job, worker), job, rules, now=NOW, rng=random.Random(seed),
                       told="operator" if cancelled else None)
    assert rescued == performed


@FAST
@given(job=leased_jobs(), window=windows, backoff=backoffs, reconciles=st.booleans(),
       worker=workers, seed=seeds)
def test_an_expired_lease_is_retried_with_backoff_or_sent_to_reconcile_never_failed(
    job: Job, window: float, backoff: Backoff, reconciles: bool, worker: str | None,
    seed: int,
) -> None:
    """Not cancelled: pending after the backoff while attempts remain and the window
    lasts; otherwise reconcile (the provider may have acted). Never failed, never done."""
    rules = Rules(window=window, backoff=backoff, reconciles=reconciles)
    decision = expired(job, rules, now=NOW, rng=random.Random(seed), worker=worker)
    assert decision.status in ("pending", "reconcile")
    assert decision.error is not None
    assert f"lease expired on attempt {job.attempt} of {job.max_attempts}" in decision.error
    assert decision.error.startswith("UnknownOutcome: ")
    started = job.first_attempted_at
    assert started is not None
    past_window = not math.isinf(window) and NOW - started >= timedelta(seconds=window)
    used_up = job.attempt >= job.max_attempts
    if past_window or used_up:
        assert decision.status == "reconcile"
        return
    if decision.status == "pending":
        bound = min(backoff.cap, backoff.base * 2.0 ** (job.attempt - 1))
        assert 0.0 <= decision.delay <= bound  # the backoff, as a perform's retry
        return
    # Reconcile within the window and attempts: only for an effect that reconciles,
    # whose next retry would come after the window closes.
    assert reconciles and "the window closes before the next attempt" in decision.error
    assert started + timedelta(seconds=window) <= NOW + timedelta(seconds=decision.delay) or (
        decision.delay == 0.0)


@FAST
@given(job=leased_jobs(), window=windows, backoff=backoffs, reconciles=st.booleans(),
       seed=seeds)
def test_an_expired_claim_an_operator_cancelled_never_goes_back_to_pending(
    job: Job, window: float, backoff: Backoff, reconciles: bool, seed: int,
) -> None:
    """Cancelled: failed, or reconcile for an effect that reconciles (the provider is
    asked whether it acted), as a perform told to stop by an operator."""
    rules = Rules(window=window, backoff=backoff, reconciles=reconciles)
    decision = expired(job, rules, now=NOW, rng=random.Random(seed), cancelled=True)
    assert decision.status == ("reconcile" if reconciles else "failed")
    assert decision.error is not None and "cancelled by an operator while running" in (
        decision.error)


@FAST
@given(job=leased_jobs(), seed=seeds)
def test_the_rescue_and_a_raised_unknown_outcome_meet_the_same_end_with_attempts_used_up(
    job: Job, seed: int,
) -> None:
    """The case the rescue used to get wrong: attempts used up ends in reconcile, as an
    ``UnknownOutcome`` raised by the perform does (not failed)."""
    last = Job(id=job.id, effect=job.effect, key=job.key, payload={}, attempt=job.max_attempts,
               claim_version=job.max_attempts, max_attempts=job.max_attempts,
               first_attempted_at=NOW)
    rules = Rules(window=86400.0)
    rescued = expired(last, rules, now=NOW, rng=random.Random(seed))
    raised = settle(UnknownOutcome("timeout"), last, rules, now=NOW, rng=random.Random(seed))
    assert rescued.status == raised.status == "reconcile"
    assert rescued.delay == raised.delay
