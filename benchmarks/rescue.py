"""The rescue of expired leases: what one batch costs, decided by the lifecycle in Python,
beside the single statement that decided in SQL before (the baseline, kept here).

``python -m benchmarks.rescue [--dsn DSN] [--jobs N] [--runs R]``: in a fresh database,
``N`` jobs (one batch: ``RESCUE_BATCH`` at most) are claimed by a worker that "dies"
(their leases moved into the past); one batch of the rescue then takes them back. Each
way is timed ``R`` times on the same rows (claimed and expired again between runs); the
figure is the median wall clock of one batch, and the ratio of the new way to the
baseline measured in the same invocation. Never part of ``make test``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import psycopg
from psycopg import sql

import outbox
from outbox._dispatch.rescuer import RESCUE_BATCH, Rescuer
from outbox._dispatch.settings import Settings
from outbox._steps import execute, run
from outbox.sql import queries

from ._db import fresh_database, migrated, server

SCHEMA = "outbox"
EFFECT = "bench.rescued"

# The rescue as it was: decided in SQL, one statement (no backoff, no hooks, attempts used
# up -> failed). Kept as the baseline.
BASELINE = """
WITH expired AS (
    SELECT id, claim_version FROM {schema}.jobs
    WHERE status = 'running' AND lease_until < now()
    ORDER BY lease_until LIMIT %(limit)s FOR UPDATE SKIP LOCKED
)
UPDATE {schema}.jobs j
SET status = CASE
        WHEN j.cancel_version = j.claim_version THEN 'failed'
        WHEN j.first_attempted_at < now() - CAST(%(window)s AS float8) * interval '1 second'
            THEN 'reconcile'
        WHEN j.attempts >= j.max_attempts THEN 'failed'
        ELSE 'pending' END,
    last_error = 'lease expired on attempt ' || j.attempts || ' of ' || j.max_attempts
                 || ' (worker ' || j.claimed_by || ' stopped heartbeating)',
    available_at = now(), lease_until = NULL, claimed_by = NULL, updated_at = now()
FROM expired e
WHERE j.id = e.id AND j.status = 'running' AND j.claim_version = e.claim_version
  AND j.lease_until < now()
RETURNING j.id
"""


class Rescued(outbox.Effect):
    name = EFFECT

    def perform(self, job: outbox.Job) -> None:
        return None


def _claim_and_expire(conn: psycopg.Connection[tuple[object, ...]], jobs: int) -> None:
    """Every job pending again, then claimed by a worker that died (leases expired)."""
    jobs_table = sql.SQL("{}.jobs").format(sql.Identifier(SCHEMA))
    conn.execute(sql.SQL("UPDATE {} SET status = 'pending', available_at = now() - "
                         "interval '1 second', lease_until = NULL, claimed_by = NULL")
                 .format(jobs_table))
    conn.execute(queries(SCHEMA).claim, {
        "effects": "{" + EFFECT + "}", "limit": jobs, "lease": 30.0, "worker": "dead",
        "after": "{}"})
    conn.execute(sql.SQL("UPDATE {} SET lease_until = now() - interval '1 second' "
                         "WHERE status = 'running'").format(jobs_table))


def _timed(conn: psycopg.Connection[tuple[object, ...]], jobs: int, runs: int,
           rescue: Callable[[], int]) -> list[float]:
    seconds = []
    for _ in range(runs):
        _claim_and_expire(conn, jobs)
        started = time.perf_counter()
        rescued = rescue()
        seconds.append(time.perf_counter() - started)
        assert rescued == jobs, (rescued, jobs)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=None, help="a server (default: an embedded one)")
    parser.add_argument("--jobs", type=int, default=RESCUE_BATCH)
    parser.add_argument("--runs", type=int, default=9)
    args = parser.parse_args()
    jobs = min(args.jobs, RESCUE_BATCH)
    with server(args.dsn) as srv, fresh_database(srv, "rescue") as dsn:
        migrated(dsn, SCHEMA)
        with psycopg.connect(dsn, autocommit=True) as conn, \
                outbox.transaction(conn, schema=SCHEMA) as tx:
            tx.enqueue_many(outbox.NewJob(EFFECT, f"k{n}", {}, max_attempts=5)
                            for n in range(jobs))
        settings = Settings.build(dsn, [Rescued()], schema=SCHEMA)
        rescuer = Rescuer(settings, random.Random(0))
        baseline = sql.SQL(BASELINE).format(schema=sql.Identifier(SCHEMA))
        with psycopg.connect(dsn, autocommit=True) as conn:
            def old() -> int:
                return len(conn.execute(baseline, {"limit": RESCUE_BATCH,
                                                   "window": 86400.0}).fetchall())

            def new() -> int:
                return len(run(rescuer.rescue(settings.queries),
                               lambda statement: execute(conn, statement)))  # type: ignore[arg-type]

            _timed(conn, jobs, 2, old)  # warm both up: caches, plans
            _timed(conn, jobs, 2, new)
            before = statistics.median(_timed(conn, jobs, args.runs, old))
            after = statistics.median(_timed(conn, jobs, args.runs, new))
    print(f"one rescue batch of {jobs} expired leases, median of {args.runs} runs:")
    print(f"  decided in SQL (baseline)        {before * 1000:8.1f} ms")
    print(f"  read, decided by the lifecycle,  {after * 1000:8.1f} ms   "
          f"{after / before:.2f}x the baseline")
    print("  applied by settle (fenced)")


if __name__ == "__main__":
    main()
