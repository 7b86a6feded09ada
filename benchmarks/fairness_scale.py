"""Section ``fairness-scale``: fair claiming across many groups, against the same jobs
without groups.

``big`` no-op jobs in group "big" are enqueued first, then ``small`` jobs each in a group
of its own (g00000, g00001, ...); the baseline is the same jobs with ``group=None``, so
there the small jobs queue behind the big backlog. Each run has a fresh database; jobs
are enqueued with ``enqueue_many`` in transactions of ``CHUNK``, then every table is
VACUUM ANALYZEd and a CHECKPOINT taken, outside the clock. One ``Dispatcher`` process
with the drain section's settings (``cli.BEST_OUTBOX``) drains them with
``run_until_idle``; grouped and ungrouped runs alternate.

Figures: the drain's throughput (wall clock from the release of the prepared worker to
its return, as the drain section times it); the claim's cost from the ``DispatchStats``
``run_until_idle`` returns (``claim_seconds / claim_queries`` and
``claim_seconds_max``); and the fairness payoff: when the last of the small groups' jobs
was done (its ledger row's ``recorded_at``), after the drain's start (the server's clock
read just before the release).

Before the first run's drains, one claim of ``batch_size`` jobs at the full state (every
group busy) is run under ``EXPLAIN (ANALYZE, BUFFERS)`` and rolled back, with groups and
without; with groups also one at the drain's tail (the big group and ``batch_size // 2``
small ones left, fewer busy groups than the claim takes, so the claim tops up past the
groups' shares). The plans go to the results file.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

import psycopg

import outbox
from outbox.sql import queries

from ._db import Server, fresh_database, migrated, scalar, settle
from ._drain_workers import OutboxSettings, OutboxSpec, outbox_worker
from ._effects import NOOP, payload
from ._procs import run_released
from ._results import Row, Section, Target
from ._seed import CHUNK
from ._stats import Figure, ratios
from .bloat import claim_params

log = logging.getLogger("benchmarks.fairness_scale")

SCHEMA = "outbox"
BIG_GROUP = "big"

_LAST_DONE = """
SELECT extract(epoch FROM max(r.recorded_at) FILTER (WHERE r.key LIKE 'small-%%') - %(start)s),
       extract(epoch FROM max(r.recorded_at) FILTER (WHERE r.key LIKE 'big-%%') - %(start)s),
       extract(epoch FROM percentile_disc(0.5) WITHIN GROUP (ORDER BY r.recorded_at)
               FILTER (WHERE r.key LIKE 'small-%%') - %(start)s),
       count(*)
FROM outbox.effect_results r
"""


@dataclass(frozen=True)
class FairnessScaleConfig:
    runs: int
    big: int = 100_000
    small: int = 10_000
    outbox: OutboxSettings = field(default_factory=OutboxSettings)
    explain: bool = True

    @property
    def jobs(self) -> int:
        return self.big + self.small

    def timeout(self) -> float:
        return 60.0 + self.jobs / 100


def _jobs(config: FairnessScaleConfig, grouped: bool) -> list[outbox.NewJob]:
    """The big group's jobs first, then one job in each small group."""
    width = max(5, len(str(config.small - 1)))
    big = [outbox.NewJob(NOOP, key=f"big-{n}", payload=payload(n),
                         group=BIG_GROUP if grouped else None) for n in range(config.big)]
    small = [outbox.NewJob(NOOP, key=f"small-{n}", payload=payload(n),
                           group=f"g{n:0{width}d}" if grouped else None)
             for n in range(config.small)]
    return big + small


def _enqueue(dsn: str, jobs: list[outbox.NewJob]) -> float:
    """``enqueue_many`` in transactions of ``CHUNK`` jobs, in order; jobs/s."""
    started = time.perf_counter()
    with psycopg.connect(dsn) as conn:
        for first in range(0, len(jobs), CHUNK):
            with outbox.transaction(conn, schema=SCHEMA) as tx:
                tx.enqueue_many(jobs[first:first + CHUNK])
    return len(jobs) / (time.perf_counter() - started)


def explain_claim(dsn: str, limit: int, keep_small: int | None = None) -> dict[str, Any]:
    """The dispatcher's claim of ``limit`` jobs under EXPLAIN (ANALYZE, BUFFERS), rolled
    back: its plan as text, the execution time (ms) and the busy groups then. With
    ``keep_small``, the small jobs past the first ``keep_small`` are deleted first (in
    the same rolled-back transaction): the state of the drain's tail, fewer busy groups
    than the claim's limit."""
    query = queries(SCHEMA).claim
    params = claim_params(query, limit)
    with psycopg.connect(dsn) as conn:
        conn.execute("SET default_transaction_isolation = 'read committed'")
        if keep_small is not None:
            conn.execute("DELETE FROM outbox.jobs WHERE key LIKE 'small-%%' "
                         "AND substr(key, 7)::integer >= %s", (keep_small,))
        groups = conn.execute(
            "SELECT count(DISTINCT coalesce(group_key, '')) FROM outbox.jobs "
            "WHERE status = 'pending'").fetchone()
        rows = conn.execute("EXPLAIN (ANALYZE, BUFFERS) " + query, params).fetchall()
        conn.rollback()
    plan = [str(row[0]) for row in rows]
    execution = next((float(line.split(":")[1].split()[0]) for line in plan
                      if line.startswith("Execution Time:")), float("nan"))
    return {"limit": limit, "busy_groups": groups[0] if groups else None,
            "execution_ms": execution, "plan": plan}


def measure(server: Server, config: FairnessScaleConfig, *, grouped: bool,
            explain: bool) -> dict[str, Any]:
    """One drain of the big group and the small ones, in a fresh database."""
    jobs = _jobs(config, grouped)
    with fresh_database(server, "fairscale") as dsn:
        migrated(dsn)
        enqueue_rate = _enqueue(dsn, jobs)
        settle(dsn)
        plans: dict[str, Any] = {}
        if explain:
            limit = config.outbox.batch_size or 100
            plans["full"] = explain_claim(dsn, limit)
            if grouped and config.small > limit // 2:
                plans["tail"] = explain_claim(dsn, limit, keep_small=limit // 2)
        timeout = config.timeout()
        starts: list[datetime] = []
        with psycopg.connect(dsn, autocommit=True) as clock:
            def read_start(pids: list[int]) -> None:
                row = clock.execute("SELECT clock_timestamp()").fetchone()
                assert row is not None
                starts.append(row[0])

            released = run_released(outbox_worker, [OutboxSpec(dsn, config.outbox, timeout)],
                                    timeout=timeout + 30, before_release=read_start)
            row = clock.execute(_LAST_DONE, {"start": starts[0]}).fetchone()
        left = scalar(dsn, "SELECT count(*) FROM outbox.jobs WHERE status <> 'done'")
    assert row is not None
    stats = released.results[0]
    if (row[3], left, stats["done"]) != (config.jobs, 0, config.jobs):
        raise AssertionError(f"fairness-scale drain: {row[3]} ledger rows, {left} jobs not "
                             f"done, {stats['done']} done by the dispatcher, of "
                             f"{config.jobs}")
    queries_run = max(1, int(stats["claim_queries"]))
    result = {
        "grouped": grouped, "seconds": released.seconds,
        "jobs_per_second": config.jobs / released.seconds,
        "enqueue_per_second": enqueue_rate,
        "claim_mean_ms": 1000 * float(stats["claim_seconds"]) / queries_run,
        "claim_max_ms": 1000 * float(stats["claim_seconds_max"]),
        "claim_queries": int(stats["claim_queries"]),
        "claim_seconds": float(stats["claim_seconds"]),
        "small_last_done": float(row[0]), "big_last_done": float(row[1]),
        "small_median_done": float(row[2]), "stats": stats, "explain": plans,
    }
    log.info("fairness-scale %s: %.0f jobs/s, claim %.1f ms mean, small groups' last "
             "done at %.2f s", "grouped" if grouped else "ungrouped",
             result["jobs_per_second"], result["claim_mean_ms"], result["small_last_done"])
    return result


def run(server: Server, config: FairnessScaleConfig) -> Section:
    """With groups and without, ``config.runs`` times each, alternating."""
    results: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
    for i in range(config.runs):
        for grouped in (True, False):
            results[grouped].append(measure(server, config, grouped=grouped,
                                            explain=config.explain and i == 0))

    def values(grouped: bool, key: str) -> list[float]:
        return [r[key] for r in results[grouped]]

    def row(name: str, unit: str, key: str, target: Target | None = None) -> Row:
        mine, base = values(True, key), values(False, key)
        return Row("fairness-scale", name, unit, Figure.of(mine), "without groups",
                   Figure.of(base), ratios(mine, base), target)

    what = (f"{config.big:,} jobs in one group, then {config.small:,} in a group each "
            f"({config.small + 1:,} groups)")
    rows = [
        row(f"{what}: the drain, with groups", "jobs/s", "jobs_per_second",
            Target(">=", 0.85)),
        row(f"{what}: claim, mean (claim_seconds / claim_queries), with groups", "ms",
            "claim_mean_ms"),
        row(f"{what}: claim, worst (claim_seconds_max), with groups", "ms", "claim_max_ms"),
        row(f"{what}: the last of the {config.small:,} small groups' jobs done after the "
            "drain's start, with groups", "s", "small_last_done"),
    ]
    settings = {"dispatcher": f"one Dispatcher process, run_until_idle, "
                f"{config.outbox.describe()}",
                "order": f"the {config.big:,} big-group jobs enqueued first, then the "
                f"{config.small:,} small ones; without groups the same jobs, group=None",
                "targets": "drain >= 0.85 of without groups (the fairness section's)"}
    raw = {"config": asdict(config),
           "runs": {("with groups" if grouped else "without groups"): found
                    for grouped, found in results.items()}}
    return Section("fairness-scale", rows, raw=raw, settings=settings)
