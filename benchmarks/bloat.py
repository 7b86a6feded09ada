"""Section 5, bloat: drain throughput and claim latency with a long history of finished
jobs (and their ledger rows) in the tables, against a fresh table.

The history is inserted directly as 'done' rows with ledger rows (generate_series), then
VACUUM ANALYZE runs as autovacuum would. The bloated database is built once and reused
by every run; the fresh one is new for every run. Claim latency times the dispatcher's
own claim statement (``outbox.sql.queries(schema).claim``, limit 100) from Python.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from outbox.sql import queries

from ._db import Server, fresh_database, migrated, scalar, settle, table
from ._drain_workers import OutboxSettings, OutboxSpec, outbox_worker
from ._effects import NOOP
from ._procs import run_released
from ._results import Row, Section, Target
from ._seed import seed_history, seed_pending
from ._stats import Figure, percentile, ratios

SCHEMA = "outbox"


@dataclass(frozen=True)
class BloatConfig:
    runs: int
    history: int
    jobs: int
    claim_samples: int
    claim_limit: int = 100
    outbox: OutboxSettings = field(default_factory=OutboxSettings)


def claim_params(query: str, limit: int) -> dict[str, Any]:
    """Parameters for the claim statement, by the names it uses."""
    known: dict[str, Any] = {"effects": [NOOP], "limit": limit, "lease": 30.0,
                             "worker": "bench-claim-latency", "after": "{}"}
    names = set(re.findall(r"%\((\w+)\)s", query))
    unknown = names - known.keys()
    if unknown:
        raise RuntimeError(f"the claim query takes parameters the benchmark does not know: "
                           f"{sorted(unknown)}; teach benchmarks/bloat.py about them")
    return {name: known[name] for name in names}


def claim_latencies(dsn: str, samples: int, limit: int) -> list[float]:
    """Milliseconds per claim of ``limit`` jobs, one autocommit statement each."""
    query = queries(SCHEMA).claim
    params = claim_params(query, limit)
    latencies = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET default_transaction_isolation = 'read committed'")
        for _ in range(samples):
            began = time.perf_counter()
            claimed = len(conn.execute(query, params).fetchall())
            latencies.append((time.perf_counter() - began) * 1000)
            if claimed < limit:
                raise AssertionError(f"a claim took {claimed} of {limit} jobs")
    return latencies


def _drain(dsn: str, config: BloatConfig, prefix: str) -> float:
    seed_pending(dsn, config.jobs, prefix=prefix)
    settle(dsn)
    timeout = 60.0 + config.jobs / 100
    released = run_released(outbox_worker, [OutboxSpec(dsn, config.outbox, timeout)],
                            timeout=timeout + 30)
    if released.results[0]["done"] != config.jobs:
        raise AssertionError(f"bloat drain finished {released.results[0]['done']} jobs")
    return config.jobs / released.seconds


def _claims(dsn: str, config: BloatConfig, prefix: str) -> list[float]:
    seed_pending(dsn, config.claim_samples * config.claim_limit, prefix=prefix)
    settle(dsn)
    latencies = claim_latencies(dsn, config.claim_samples, config.claim_limit)
    with psycopg.connect(dsn, autocommit=True) as conn:  # as if done and purged
        conn.execute(sql.SQL("DELETE FROM {} WHERE key LIKE %s").format(
            table(SCHEMA, "jobs")), (prefix + "%",))
    return latencies


def measure(dsn: str, config: BloatConfig, run_number: int) -> dict[str, Any]:
    """One run in the database at ``dsn``: a drain, then the claim samples."""
    rows_before = scalar(dsn, sql.SQL("SELECT count(*) FROM {}").format(table(SCHEMA, "jobs")))
    rate = _drain(dsn, config, f"drain{run_number}-")
    latencies = _claims(dsn, config, f"claim{run_number}-")
    return {"rows_before": rows_before, "jobs_per_second": rate, "claim_ms": latencies,
            "claim_p50_ms": percentile(latencies, 0.5),
            "claim_p99_ms": percentile(latencies, 0.99)}


def _rows(config: BloatConfig, fresh: list[dict[str, Any]],
          bloated: list[dict[str, Any]]) -> list[Row]:
    label = f"{config.history:,} finished jobs"
    rows = []
    drain_b = [r["jobs_per_second"] for r in bloated]
    drain_f = [r["jobs_per_second"] for r in fresh]
    rows.append(Row("bloat", f"drain {config.jobs:,} after {label}", "jobs/s",
                    Figure.of(drain_b), "fresh table", Figure.of(drain_f),
                    ratios(drain_b, drain_f), Target(">=", 0.9)))
    for key, name in (("claim_p50_ms", "p50"), ("claim_p99_ms", "p99")):
        b, f = [r[key] for r in bloated], [r[key] for r in fresh]
        rows.append(Row("bloat", f"claim latency {name} (limit {config.claim_limit}) after "
                        f"{label}", "ms", Figure.of(b), "fresh table", Figure.of(f),
                        ratios(b, f)))
    return rows


def run(server: Server, config: BloatConfig) -> Section:
    """Build the history once; then each run measures the fresh and the bloated table."""
    fresh: list[dict[str, Any]] = []
    bloated: list[dict[str, Any]] = []
    with fresh_database(server, "bloated") as bloated_dsn:
        migrated(bloated_dsn)
        began = time.perf_counter()
        history_rate = seed_history(bloated_dsn, config.history)
        settle(bloated_dsn)
        prepared_in = time.perf_counter() - began
        for run_number in range(config.runs):
            with fresh_database(server, "fresh") as fresh_dsn:
                migrated(fresh_dsn)
                fresh.append(measure(fresh_dsn, config, run_number))
            bloated.append(measure(bloated_dsn, config, run_number))
    settings = {"history": f"{config.history:,} done jobs + ledger rows, then VACUUM ANALYZE "
                f"({prepared_in:.0f}s)", "claim samples": f"{config.claim_samples} per run",
                "outbox": config.outbox.describe()}
    raw = {"config": asdict(config), "history_rows_per_second": history_rate,
           "fresh": fresh, "bloated": bloated}
    return Section("bloat", _rows(config, fresh, bloated), raw=raw, settings=settings)
