"""The counting rule shared by the overview and /metrics (pure, no database)."""

from __future__ import annotations

from outbox import _queue as _counts
from outbox._queue import Counted, Sampled


def test_small_tables_are_counted_exactly_and_large_ones_sampled() -> None:
    assert _counts.exact(199_999)
    assert not _counts.exact(200_000)
    assert _counts.sample_percent(1_000_000) == 2.0
    assert _counts.sample_percent(10) == 100.0
    assert _counts.sample_percent(0) == 100.0


def test_done_jobs_are_the_estimate_less_the_unfinished_split_as_sampled() -> None:
    counts = _counts.with_done_estimated(
        [Counted("pending", "email", 1000), Counted("failed", "charge", 200)],
        [Sampled("email", 300), Sampled("charge", 100)], estimate=1_001_200)
    assert counts == {("pending", "email"): 1000, ("failed", "charge"): 200,
                      ("done", "email"): 750_000, ("done", "charge"): 250_000}


def test_an_empty_sample_estimates_no_done_jobs() -> None:
    assert _counts.with_done_estimated([Counted("pending", "e", 5)], [],
                                       estimate=300_000) == {
        ("pending", "e"): 5}
