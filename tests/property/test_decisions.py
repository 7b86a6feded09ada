"""Properties of the pure lifecycle decisions (``outbox._lifecycle``), without a database."""

from __future__ import annotations

import math
import random
from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from outbox import Backoff, Job, Permanent, Retry, UnknownOutcome
from outbox._lifecycle import MAX_ERROR_LENGTH, Decision, Rules, settle

FAST = settings(max_examples=300, deadline=None, database=None)
NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)
DAY = 86400.0
# now() + delay must stay a valid timestamptz (PostgreSQL's calendar ends in 294276 AD),
# or the settle statement that writes available_at fails and the outcome is lost.
MAX_STORABLE_DELAY = 1e12

bases = st.floats(min_value=0.0, max_value=1e6, allow_nan=False)
caps = st.floats(min_value=0.0, max_value=1e7, allow_nan=False)
attempts = st.integers(min_value=1, max_value=10_000)
seeds = st.integers(min_value=0, max_value=2**32)
messages = st.text(max_size=50)


@FAST
@given(base=bases, cap=caps, attempt=attempts, seed=seeds)
def test_backoff_delay_stays_within_the_capped_exponential(
    base: float, cap: float, attempt: int, seed: int
) -> None:
    delay = Backoff(base=base, cap=cap).delay(attempt, random.Random(seed))
    bound = min(cap, base * 2.0 ** min(attempt - 1, 1023)) if base else 0.0
    assert 0.0 <= delay <= bound


@FAST
@given(base=st.floats(min_value=0.001, max_value=10), seed=seeds)
def test_backoff_bound_doubles_until_the_cap(base: float, seed: int) -> None:
    """Full jitter over [0, bound]: the bound doubles per attempt until it meets the cap."""
    backoff = Backoff(base=base, cap=base * 8)
    rng = random.Random(seed)
    highest = [max(backoff.delay(n, rng) for _ in range(200)) for n in range(1, 7)]
    limits = [base, 2 * base, 4 * base, 8 * base, 8 * base, 8 * base]
    assert all(h <= limit for h, limit in zip(highest, limits, strict=True))
    assert highest[3] > 4 * base * 0.5  # the jitter does reach well into the doubled range


def _outcomes() -> st.SearchStrategy[BaseException]:
    afters = st.none() | st.floats(min_value=0.0, max_value=1e6, allow_nan=False)
    return st.one_of(
        st.builds(Retry, messages, after=afters),
        st.builds(Permanent, messages),
        st.builds(UnknownOutcome, messages, after=afters),
        st.builds(RuntimeError, messages),
        st.builds(ValueError, messages),
        st.builds(ConnectionResetError, messages),
    )


def _decide(
    error: BaseException, attempt: int, max_attempts: int, age: timedelta, window: float, seed: int
) -> Decision:
    job = Job(id=1, effect="e", key="k", payload={}, attempt=attempt, claim_version=1,
              max_attempts=max_attempts, first_attempted_at=NOW - age)
    return settle(error, job, Rules(window=window, backoff=Backoff(base=1.0, cap=60.0)),
                  now=NOW, rng=random.Random(seed))


@FAST
@given(
    error=_outcomes(),
    attempt=st.integers(min_value=1, max_value=50),
    max_attempts=st.integers(min_value=1, max_value=50),
    age=st.integers(min_value=0, max_value=3 * 86400 * 10**6).map(
        lambda us: timedelta(microseconds=us)
    ),
    window=st.sampled_from([0.0, 60.0, DAY]),
    seed=seeds,
)
def test_settle(
    error: BaseException, attempt: int, max_attempts: int, age: timedelta, window: float,
    seed: int,
) -> None:
    decision = _decide(error, attempt, max_attempts, age, window, seed)
    assert decision.status in ("pending", "failed", "reconcile")
    # reconcile only ever for an unknown outcome, and an unknown outcome never fails.
    past_window = age >= timedelta(seconds=window)
    assert (decision.status == "reconcile") == (
        isinstance(error, UnknownOutcome) and (attempt >= max_attempts or past_window)
    )
    if isinstance(error, Permanent):
        assert decision.status == "failed"
    elif not isinstance(error, UnknownOutcome):
        assert decision.status == ("failed" if attempt >= max_attempts else "pending")
    # Failure text is always kept, named by type, and bounded.
    assert decision.error is not None
    assert decision.error.startswith(type(error).__name__ + ":")
    assert len(decision.error) <= MAX_ERROR_LENGTH + 64
    # A retry waits Retry.after when given, else the backoff; never negative.
    if decision.status == "pending":
        after = getattr(error, "after", None)
        if after is not None:
            assert decision.delay == after
        else:
            assert 0.0 <= decision.delay <= min(60.0, 2.0 ** (attempt - 1))


@FAST
@given(
    error=st.sampled_from([RuntimeError, Permanent, Retry, UnknownOutcome]),
    length=st.integers(min_value=MAX_ERROR_LENGTH - 50, max_value=200_000),
    attempt=st.integers(min_value=1, max_value=3),
)
def test_error_text_is_bounded(error: type[Exception], length: int, attempt: int) -> None:
    decision = _decide(error("e" * length), attempt, 3, timedelta(0), DAY, 0)
    assert decision.error is not None
    assert len(decision.error) <= MAX_ERROR_LENGTH + 64


@FAST
@given(
    after=st.floats(min_value=0.0) | st.just(math.nan),
    unknown=st.booleans(),
    seed=seeds,
)
def test_any_requested_delay_becomes_one_the_database_can_store(
    after: float, unknown: bool, seed: int
) -> None:
    """Whatever ``after`` an effect (or a provider's Retry-After) asks for, the decision's
    delay is a finite, non-negative number of seconds that PostgreSQL can add to now()."""
    try:
        error: Exception = UnknownOutcome("u", after=after) if unknown else Retry("r", after=after)
    except ValueError:
        return  # refusing a nonsensical delay up front is fine too
    decision = _decide(error, 1, 5, timedelta(0), DAY, seed)
    assert decision.status == "pending"
    assert math.isfinite(decision.delay)
    assert 0.0 <= decision.delay <= MAX_STORABLE_DELAY


@FAST
@given(
    outcome=st.none() | _outcomes(),
    hook_error=_outcomes(),
    attempt=st.integers(min_value=1, max_value=50),
    max_attempts=st.integers(min_value=1, max_value=50),
    reconciles=st.booleans(),
    seed=seeds,
)
def test_a_hook_that_raised_is_retried_or_failed_never_reconciled(
    outcome: BaseException | None, hook_error: BaseException, attempt: int,
    max_attempts: int, reconciles: bool, seed: int,
) -> None:
    """The provider's outcome is known when a hook raises: whatever either raised, the job
    is retried with the backoff until its attempts run out (a ``Permanent`` from the
    hook: at once), then failed; and the error names the hook that raised."""
    job = Job(id=1, effect="e", key="k", payload={}, attempt=attempt, claim_version=1,
              max_attempts=max_attempts, first_attempted_at=NOW - timedelta(days=30))
    rules = Rules(window=60.0, backoff=Backoff(base=1.0, cap=60.0), reconciles=reconciles)
    decision = settle(outcome, job, rules, now=NOW, rng=random.Random(seed),
                      hook_error=hook_error)
    gives_up = isinstance(hook_error, Permanent) or attempt >= max_attempts
    assert decision.status == ("failed" if gives_up else "pending")
    assert 0.0 <= decision.delay <= (0.0 if gives_up else 60.0)
    hook = "on_done" if outcome is None else "on_failed"
    assert decision.error is not None and f"{hook} raised " in decision.error
