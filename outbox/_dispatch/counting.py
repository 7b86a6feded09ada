"""``DispatchStats`` and the one place that fills it from the dispatcher's events.

The parts (claimer, recorder) report what happened to ``DispatchObserver`` events and
count nothing themselves; ``StatsObserver`` turns those events into the counters a run
returns, so the counters and any metrics observer hear the same things.
(``outbox.DispatchStats`` and ``outbox.dispatcher.DispatchStats`` name this class.)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any, overload

from ..observe import AttemptOutcome, DispatchObserver, PurgedTable, ReconnectingPart

__all__ = ["DispatchStats", "StatsObserver", "Waits"]


@dataclass
class DispatchStats:
    """Counters of one ``run`` or ``run_until_idle`` call.

    ``stale_completions`` counts fenced writes that changed 0 rows because the claim had
    been lost (lease expired and re-claimed); ``lost_claims`` counts claims a heartbeat
    found gone. Both are expected after a stall, and harmless: the later claim wins.
    ``rescued`` counts expired leases this dispatcher took back. ``claim_queries`` and
    ``claim_seconds`` give the claim latency (``claim_seconds / claim_queries`` on
    average, ``claim_seconds_max`` at worst). ``purged`` counts rows retention deleted
    (done jobs, ledger and inbox rows); ``reconnects``, lost connections replaced.

    Counted from the ``outbox.observe.DispatchObserver`` events the dispatcher reports
    (``claimed``, ``recorded``, ``claims_lost``, ``rescued``, ``reconnected``,
    ``purged``), so an observer of its own hears exactly what these counters hold.

    :var claimed: Jobs claimed (each claim of a job counts).
    :var done: Jobs recorded ``done``.
    :var retried: Attempts recorded for a retry (the job back to ``pending``, later).
    :var failed: Jobs recorded ``failed`` (a permanent error, attempts used up).
    :var reconcile: Jobs sent to ``reconcile`` (an unknown outcome past its window).
    :var released: Claimed jobs handed back unstarted at a stop (attempt refunded).
    :var rescued: Expired leases of other claims this dispatcher took back.
    :var lost_claims: Claims a heartbeat found taken over (their outcome not recorded).
    :var stale_completions: Fenced writes that changed no row: the claim had been lost.
    :var reconnects: Lost database connections replaced.
    :var purged: Rows retention deleted (done jobs, ledger and inbox rows).
    :var claim_queries: Claim statements run.
    :var claim_seconds: Seconds spent in them, in total.
    :var claim_seconds_max: The slowest claim statement, in seconds.
    """

    claimed: int = 0
    done: int = 0
    retried: int = 0
    failed: int = 0
    reconcile: int = 0
    released: int = 0
    rescued: int = 0
    lost_claims: int = 0
    stale_completions: int = 0
    reconnects: int = 0
    purged: int = 0
    claim_queries: int = 0
    claim_seconds: float = 0.0
    claim_seconds_max: float = 0.0

    def as_dict(self) -> dict[str, int | float]:
        """The counters as a plain dict (for logs and JSON)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


# Which counter an outcome the recorder wrote adds to.
_COUNTERS: dict[AttemptOutcome, str] = {
    "done": "done", "retry": "retried", "failed": "failed", "reconcile": "reconcile",
    "released": "released", "lost": "stale_completions",
}


class StatsObserver(DispatchObserver):
    """Counts one run's ``DispatchStats`` from the batch events (never per job).

    Each counter has one writer thread (the claimer's events, or the recorder's),
    except ``reconnects``, which both report: a rare lost increment there is harmless.
    """

    def __init__(self, stats: DispatchStats) -> None:
        self.stats = stats  # replaced at the start of each run

    def claimed(self, duration: float, waits: Sequence[tuple[str, float]]) -> None:
        stats = self.stats
        stats.claim_queries += 1
        stats.claim_seconds += duration
        stats.claim_seconds_max = max(stats.claim_seconds_max, duration)
        stats.claimed += len(waits)

    def rescued(self, count: int) -> None:
        self.stats.rescued += count

    def recorded(self, outcome: AttemptOutcome, count: int) -> None:
        counter = _COUNTERS[outcome]
        setattr(self.stats, counter, getattr(self.stats, counter) + count)

    def claims_lost(self, count: int) -> None:
        self.stats.lost_claims += count

    def reconnected(self, part: ReconnectingPart) -> None:
        self.stats.reconnects += 1

    def purged(self, table: PurgedTable, count: int) -> None:
        self.stats.purged += count


# Where a claimed row holds its effect and how long it was due (claimer.CLAIMED).
EFFECT_COLUMN, WAITED_COLUMN = 1, 9


class Waits(Sequence[tuple[str, float]]):
    """The ``(effect, seconds due)`` pairs of one claim, made only when read: counting
    needs the length alone, so a dispatcher without a metrics observer builds none.
    The rows are a claim's (tuples in the order of ``claimer.CLAIMED``)."""

    __slots__ = ("_rows",)

    def __init__(self, rows: Sequence[Any]) -> None:  # named tuples of the claim
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, index: int) -> tuple[str, float]: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[tuple[str, float]]: ...

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [(row[EFFECT_COLUMN], float(row[WAITED_COLUMN]))
                    for row in self._rows[index]]
        row = self._rows[index]
        return (row[EFFECT_COLUMN], float(row[WAITED_COLUMN]))

    def __iter__(self) -> Iterator[tuple[str, float]]:
        return ((row[EFFECT_COLUMN], float(row[WAITED_COLUMN])) for row in self._rows)
