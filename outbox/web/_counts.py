"""Jobs per (status, effect), exact on a small table and estimated on a large one.

Pure: the dashboard (async) and the metrics collector (sync) run the queries and hand
their rows here, so both count the same way.
"""

from __future__ import annotations

from collections.abc import Iterable

EXACT_COUNT_LIMIT = 200_000
"""Below this many rows (the planner's estimate), every status is counted exactly."""
SAMPLE_ROWS = 20_000
"""Rows a block sample should see when done jobs are estimated."""

Counts = dict[tuple[str, str], int]


def exact(estimate: int) -> bool:
    """Whether a table of about ``estimate`` rows is small enough to count exactly."""
    return estimate < EXACT_COUNT_LIMIT


def sample_percent(estimate: int) -> float:
    """The TABLESAMPLE percentage that sees about ``SAMPLE_ROWS`` rows."""
    return min(100.0, 100.0 * SAMPLE_ROWS / max(estimate, 1))


def with_done_estimated(unfinished: Iterable[tuple[str, str, int]],
                        sample: Iterable[tuple[str, int]], estimate: int) -> Counts:
    """Exact counts of the unfinished states plus done jobs estimated: the table's row
    estimate less the unfinished jobs, split by effect as in the sample."""
    counts = {(status, effect): int(n) for status, effect, n in unfinished}
    sampled = {effect: int(n) for effect, n in sample}
    done_total = max(0, estimate - sum(counts.values()))
    seen = sum(sampled.values())
    for effect, n in sampled.items():
        counts[("done", effect)] = round(done_total * n / seen)
    return counts
