"""Sampling, every ~100 ms, how long any job has stayed ``running`` past its lease, and
how many jobs of each group run at once under a concurrency limit."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import psycopg

from outbox import Limit

from ._sql import ChaosQueries
from .database import connect

__all__ = ["LeaseMonitor"]

_EXAMPLES = 10


@dataclass
class LeaseMonitor:
    """``max_overrun`` is the largest ``now() - lease_until`` seen over running jobs
    (seconds; 0 when no lease was ever seen expired), ``worst_key`` that job's key.
    Samples are lost while the database is down (a restart): ``failed`` counts them.

    For each effect of ``limits`` with a concurrency, each sample also counts its running
    jobs, per group under a limit per group (the jobs with no group are a group of their
    own), else for the whole effect: what the limit counts at each claim, read in one
    snapshot. ``most_running`` keeps the most seen per effect, ``over`` the samples that
    saw more than the limit (``over_samples`` counts them). A limit is counted in each
    target's own tables, so with several ``targets`` each target is counted apart (and
    named in ``over``).
    """

    dsn: str
    queries: ChaosQueries
    interval: float = 0.1
    limits: Mapping[str, Limit] = field(default_factory=dict)
    targets: int = 1
    max_overrun: float = 0.0
    worst_key: str | None = None
    samples: int = 0
    failed: int = 0
    most_running: dict[str, int] = field(default_factory=dict)
    over: list[str] = field(default_factory=list)
    over_samples: int = 0

    def __post_init__(self) -> None:
        self._capped = {effect: limit for effect, limit in self.limits.items()
                        if limit.concurrency is not None}
        self.most_running = dict.fromkeys(self._capped, 0)

    def run(self, stop: threading.Event) -> None:
        """Sample until ``stop`` is set."""
        conn: psycopg.Connection[Any] | None = None
        try:
            while not stop.wait(self.interval):
                conn = self._sample(conn)
        finally:
            if conn is not None:
                conn.close()

    def _sample(self, conn: psycopg.Connection[Any] | None) -> psycopg.Connection[Any] | None:
        try:
            if conn is None or conn.closed:
                conn = connect(self.dsn, "chaos monitor")
            row = conn.execute(self.queries.lease_overrun, {}).fetchone()
            running = conn.execute(self.queries.running_per_group,
                                   {"effects": sorted(self._capped)}).fetchall() \
                if self._capped else []
        except psycopg.OperationalError:
            self.failed += 1
            if conn is not None:
                conn.close()
            return None
        self.samples += 1
        if row is not None and float(row[0]) > self.max_overrun:
            self.max_overrun = float(row[0])
            self.worst_key = str(row[1])
        self._count(running)
        return conn

    def _count(self, rows: list[tuple[Any, ...]]) -> None:
        """Compare one sample's running jobs with each effect's concurrency. A row is
        (effect, group, count, keys, target); the target may be left out (one target)."""
        counted: dict[tuple[str, str, str | None], list[str]] = {}
        for effect, group, _, keys, *rest in rows:
            per_group = self._capped[effect].per_group
            in_target = str(rest[0]) if rest else ""
            counted.setdefault((effect, in_target, group if per_group else None),
                               []).extend(keys)
        over = False
        for (effect, target, group), keys in counted.items():
            self.most_running[effect] = max(self.most_running[effect], len(keys))
            limit = self._capped[effect].concurrency
            if limit is not None and len(keys) > limit:
                over = True
                if len(self.over) < _EXAMPLES:
                    where = f"group {group!r}" if group is not None else "in all"
                    if self.targets > 1:
                        where += f" of target {target}"
                    self.over.append(f"{effect} {where}: {len(keys)} running at once, "
                                     f"limit {limit}: {', '.join(sorted(keys))}")
        self.over_samples += over
