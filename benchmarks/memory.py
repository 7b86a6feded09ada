"""Section 6, memory: the resident set size of one dispatcher process while it drains a
large backlog of no-op jobs, sampled every half second by the parent (VmRSS), with the
process's own peak (VmHWM) and its RSS once the drain is over (the 100% figure), as it
reports them itself. The baseline is the same process's RSS just
before release: imported, configured, connected nothing yet.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from ._db import Server, fresh_database, migrated, settle, table
from ._drain_workers import OutboxSettings, OutboxSpec, outbox_worker
from ._procs import run_released
from ._results import Row, Section, Target
from ._rss import rss
from ._seed import seed_pending
from ._stats import Figure, ratios

MB = 1024 * 1024
CHECKPOINTS = (0.1, 0.5)


@dataclass(frozen=True)
class MemoryConfig:
    runs: int
    jobs: int
    interval: float = 0.5
    outbox: OutboxSettings = field(default_factory=OutboxSettings)


class _Sampler:
    """Samples (elapsed, RSS, progress); progress is read from the claim index: the
    lowest pending id, as jobs are claimed in id order."""

    def __init__(self, dsn: str, jobs: int) -> None:
        self.jobs = jobs
        self.samples: list[tuple[float, int, float]] = []
        self.idle_rss = 0
        self._conn = psycopg.connect(dsn, autocommit=True)
        self._query = sql.SQL("SELECT id FROM {} WHERE status = 'pending' "
                              "ORDER BY available_at, id LIMIT 1").format(table("outbox", "jobs"))

    def progress(self) -> float:
        row = self._conn.execute(self._query).fetchone()
        return 1.0 if row is None else (row[0] - 1) / self.jobs

    def before_release(self, pids: list[int]) -> None:
        self.idle_rss = rss(pids[0])

    def tick(self, pids: list[int], elapsed: float) -> None:
        self.samples.append((elapsed, rss(pids[0]), self.progress()))

    def close(self) -> None:
        self._conn.close()


def _at(samples: list[tuple[float, int, float]], fraction: float) -> int:
    """RSS of the first sample at or past ``fraction`` of the drain (else the last)."""
    for _, resident, progress in samples:
        if progress >= fraction:
            return resident
    return samples[-1][1] if samples else 0


def measure(server: Server, config: MemoryConfig) -> dict[str, Any]:
    """One drain of ``config.jobs`` jobs by one dispatcher process, RSS sampled."""
    with fresh_database(server, "memory") as dsn:
        migrated(dsn)
        seed_pending(dsn, config.jobs, prefix="mem-")
        settle(dsn)
        sampler = _Sampler(dsn, config.jobs)
        timeout = 120.0 + config.jobs / 100
        try:
            released = run_released(outbox_worker, [OutboxSpec(dsn, config.outbox, timeout)],
                                    timeout=timeout + 30, tick=(config.interval, sampler.tick),
                                    before_release=sampler.before_release)
        finally:
            sampler.close()
    stats = released.results[0]
    if stats["done"] != config.jobs:
        raise AssertionError(f"memory drain finished {stats['done']} of {config.jobs}")
    return {"seconds": released.seconds, "jobs_per_second": config.jobs / released.seconds,
            "idle_rss": sampler.idle_rss, "peak_rss": stats["peak_rss_bytes"],
            "at": {**{f"{int(f * 100)}%": _at(sampler.samples, f) for f in CHECKPOINTS},
                   "100%": stats["final_rss_bytes"]},
            "samples": sampler.samples}


def run(server: Server, config: MemoryConfig) -> Section:
    """Peak RSS and RSS at 10%, 50%, 100% of the drain, each beside the idle RSS."""
    results = [measure(server, config) for _ in range(config.runs)]
    idle = [r["idle_rss"] / MB for r in results]
    peak = [r["peak_rss"] / MB for r in results]
    rows = [Row("memory", f"peak RSS over a {config.jobs:,}-job drain", "MB", Figure.of(peak),
                "idle RSS before release", Figure.of(idle), ratios(peak, idle),
                Target("<=", 200, on="value", unit=" MB"))]
    for label in [f"{int(f * 100)}%" for f in CHECKPOINTS] + ["100%"]:
        at = [r["at"][label] / MB for r in results]
        rows.append(Row("memory", f"RSS at {label} of the drain", "MB", Figure.of(at),
                        "idle RSS before release", Figure.of(idle), ratios(at, idle)))
    rows.append(Row("memory", "drain throughput while sampled", "jobs/s",
                    Figure.of([r["jobs_per_second"] for r in results])))
    settings = {"jobs": f"{config.jobs:,} no-op jobs (SQL bulk insert)",
                "sampling": f"VmRSS every {config.interval}s, VmHWM at the end",
                "outbox": config.outbox.describe()}
    return Section("memory", rows, raw={"config": asdict(config), "runs": results},
                   settings=settings)
