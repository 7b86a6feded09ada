"""Figures measured over several runs: median with its spread, percentiles, ratios."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Figure:
    """One quantity measured once per run; reported as its median and min-max spread."""

    runs: tuple[float, ...]

    @classmethod
    def of(cls, values: Sequence[float]) -> Figure:
        return cls(tuple(float(v) for v in values))

    @property
    def median(self) -> float:
        return statistics.median(self.runs) if self.runs else math.nan

    @property
    def low(self) -> float:
        return min(self.runs) if self.runs else math.nan

    @property
    def high(self) -> float:
        return max(self.runs) if self.runs else math.nan

    def as_dict(self) -> dict[str, object]:
        return {"median": self.median, "min": self.low, "max": self.high, "runs": list(self.runs)}


def ratios(numerators: Sequence[float], denominators: Sequence[float]) -> Figure:
    """Per-run ratios (run i against run i of the baseline measured beside it)."""
    pairs = zip(numerators, denominators, strict=True)
    return Figure.of([n / d if d else math.nan for n, d in pairs])


def percentile(samples: Sequence[float], fraction: float) -> float:
    """The ``fraction`` quantile (0..1) by linear interpolation; nan when empty."""
    if not samples:
        return math.nan
    ordered = sorted(samples)
    position = fraction * (len(ordered) - 1)
    lower = math.floor(position)
    upper = min(lower + 1, len(ordered) - 1)
    weight = position - lower
    return ordered[lower] * (1 - weight) + ordered[upper] * weight
