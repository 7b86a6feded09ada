"""``DispatchStats`` filled from the dispatcher's events: the one place that counts.

The parts (claimer, recorder) report what happened to ``DispatchObserver`` events and
count nothing themselves; ``StatsObserver`` turns those events into the counters a run
returns, so the counters and any metrics observer hear the same things.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, overload

from ..observe import AttemptOutcome, DispatchObserver, PurgedTable, ReconnectingPart

if TYPE_CHECKING:
    from ..dispatcher import DispatchStats

__all__ = ["StatsObserver", "Waits"]

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


class Waits(Sequence[tuple[str, float]]):
    """The ``(effect, seconds due)`` pairs of one claim, made only when read: counting
    needs the length alone, so a dispatcher without a metrics observer builds none."""

    __slots__ = ("_rows",)

    def __init__(self, rows: Sequence[tuple[Any, ...]]) -> None:
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, index: int) -> tuple[str, float]: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[tuple[str, float]]: ...

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [(row[1], float(row[9])) for row in self._rows[index]]
        row = self._rows[index]
        return (row[1], float(row[9]))

    def __iter__(self) -> Iterator[tuple[str, float]]:
        return ((row[1], float(row[9])) for row in self._rows)
