"""The counting rule shared by the overview, ``outbox status`` and /metrics (pure, no
database): exact up to the cap, a status past it estimated from a block sample."""

from __future__ import annotations

from outbox import _queue as _counts
from outbox._queue import Counted, Sampled


def test_the_sample_reads_about_sample_pages_of_any_table() -> None:
    assert _counts.sample_percent(100_000) == 100 * _counts.SAMPLE_PAGES / 100_000
    assert _counts.sample_percent(10) == 100.0
    assert _counts.sample_percent(0) == 100.0


def test_only_a_status_read_past_the_cap_is_estimated() -> None:
    counted = [Counted("pending", "email", 8), Counted("pending", "sms", 3),
               Counted("failed", "email", 5)]
    assert _counts.capped_statuses(counted, cap=10) == {"pending"}
    assert _counts.capped_statuses(counted, cap=11) == frozenset()


def test_an_estimated_status_is_the_sample_scaled_up_never_below_what_was_counted() -> None:
    counted = [Counted("pending", "email", 9000), Counted("pending", "sms", 1001),
               Counted("failed", "email", 5)]
    sample = [Sampled("pending", "email", 3000), Sampled("pending", "sms", 10),
              Sampled("pending", "push", 2), Sampled("failed", "email", 1)]
    counts = _counts.with_estimates(counted, sample, percent=2.0,
                                    estimated=frozenset({"pending"}))
    assert counts == {("pending", "email"): 150_000,  # 3,000 seen in 2 % of the pages
                      ("pending", "sms"): 1001,  # the sample's 500 is below the count
                      ("pending", "push"): 100,  # not among the jobs counted
                      ("failed", "email"): 5}  # exact: failed was not past the cap
