"""The server's CPU a job, statement by statement: ``python -m benchmarks.statement_cpu
[--dsn DSN] [--runs 3] [--jobs 20000] [--batch 2000]``, or ``--enqueue
[--transactions 2000]``.

Where the drain section's ``<system> CPU`` rows give the whole server's CPU a job (every
process of it, a clock tick at a time), this reads the one backend that runs the
statements: ``/proc/<pid>/schedstat`` (nanoseconds on a CPU) before and after each
statement, so a loaded machine changes the figures little. Each system drains the same
``--jobs`` no-op jobs (enqueued once in a template database, each run on a fresh copy of
it) on one connection, claiming ``--batch`` at a time, nothing performed:

- ``outbox``: the dispatcher's ``claim`` and ``complete_delete`` (``retention=0``);
- ``outbox-settle`` (with ``--settle``): the same claim, and the recorder's ``settle``
  writing each job failed (as ``settling.settle_claim`` builds its claims: both
  decisions, the one for a claim an operator cancelled meanwhile too);
- ``floor`` and ``floor-indexed``: the design floor's claim and fenced completion
  (``benchmarks._drain_workers``), its lease not indexed (a HOT claim) and indexed.

The systems alternate within each run. Prints µs a job for the claim and the completion,
median (min..max) over the runs, and each system's total against the floor's of the same
run. The server must run on this machine (the embedded one by default).

``--enqueue`` measures the business's side instead: transactions shaped as the business
section's single one (an order row, then one job), alternating in blocks of
``ENQUEUE_BLOCK`` between ``tx.enqueue`` and a plain INSERT of the same row into a table
of the jobs' columns with only their primary and unique keys (``bench.plain``), each
variant ``--transactions`` times a run in a fresh database. The backend's CPU of the job's
statement and of the COMMIT are read apart (the order row and BEGIN cost both alike).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import namedtuple_row
from psycopg.types.json import Jsonb

from outbox._dispatch.settling import settle_claim, settle_claims
from outbox._lifecycle import Decision
from outbox.effect import Job
from outbox.sql import Queries

from ._cpu import process_seconds
from ._db import Server, fresh_database, migrated, server
from ._drain_workers import (
    FLOOR_CLAIM,
    FLOOR_COMPLETE,
    FLOOR_LEASE_INDEX,
    FLOOR_TABLES,
    floor_sql,
)
from ._effects import Noop
from ._seed import enqueue_outbox

SYSTEMS = ("outbox", "floor", "floor-indexed")
# With --variants: our statements on the schema less one index each, to price what each
# index the claim writes to costs it (a plan needs each: see the performance page); and
# on the layout a table of the unfinished jobs alone would allow ("outbox-hot-layout"):
# no index names the status or the lease, so a claim changes no indexed column and,
# with room on its page (fillfactor 50, the rows rewritten so), is a HOT update. Not a
# design (the finished jobs, which these indexes would then hold, and the rescue's index
# of leases must go elsewhere): the price of the claim such a design could reach.
VARIANTS: dict[str, tuple[str, ...]] = {
    "outbox-no-leases": ("DROP INDEX outbox.jobs_leases",),
    "outbox-hot-layout": (
        "DROP INDEX outbox.jobs_leases", "DROP INDEX outbox.jobs_finished",
        "DROP INDEX outbox.jobs_reconcile", "DROP INDEX outbox.jobs_claimable_effect",
        "DROP INDEX outbox.jobs_fair", "DROP INDEX outbox.jobs_ordering",
        "CREATE INDEX jobs_claimable_effect ON outbox.jobs (effect, available_at, id)",
        "CREATE INDEX jobs_fair ON outbox.jobs (effect, coalesce(group_key, ''),"
        " outbox.claim_rank(available_at, priority), id)",
        "CREATE INDEX jobs_ordering ON outbox.jobs (ordering_key, id)"
        " WHERE ordering_key IS NOT NULL",
        "ALTER TABLE outbox.jobs SET (fillfactor = 50)",
        "VACUUM FULL outbox.jobs",
    ),
}


@dataclass(frozen=True)
class Drained:
    """One drain: the backend's CPU seconds in the claims and in the completions."""

    jobs: int
    claim: float
    complete: float


def _drain(conn: psycopg.Connection[Any], claim: Callable[[], list[Any]],
           complete: Callable[[list[Any]], None]) -> Drained:
    row = conn.execute("SELECT pg_backend_pid() AS pid").fetchone()
    assert row is not None
    pid = row.pid
    jobs, in_claim, in_complete = 0, 0.0, 0.0
    while True:
        before = process_seconds(pid)
        rows = claim()
        after = process_seconds(pid)
        in_claim += after - before
        if not rows:
            return Drained(jobs, in_claim, in_complete)
        jobs += len(rows)
        complete(rows)
        in_complete += process_seconds(pid) - after


def _outbox(conn: psycopg.Connection[Any], batch: int, *, settle: bool = False) -> Drained:
    queries = Queries("outbox")
    params = {"effects": [Noop.name], "limit": batch, "lease": 60.0, "worker": "cpu",
              "after": "{}"}
    failed = Decision("failed", error="Permanent: declined")

    def complete(rows: list[Any]) -> None:
        if settle:
            conn.execute(queries.settle, {"claims": settle_claims(
                settle_claim(Job(id=r.id, effect=Noop.name, key="", payload={}, attempt=1,
                                 claim_version=r.claim_version), failed)
                for r in rows)}, prepare=True)
            return
        claims = json.dumps([{"id": r.id, "version": r.claim_version, "result": None}
                             for r in rows])
        conn.execute(queries.complete_delete, {"claims": claims}, prepare=True)

    return _drain(conn, lambda: conn.execute(queries.claim, params, prepare=True).fetchall(),
                  complete)


def _floor(conn: psycopg.Connection[Any], batch: int, *, lease_index: bool) -> Drained:
    # The floor's table is built inside the measured database, from its jobs, before
    # the clock (``floor_tables`` of the drain section, on this connection).
    for statement in FLOOR_TABLES.split(";") + ([FLOOR_LEASE_INDEX] if lease_index else []):
        conn.execute(floor_sql(statement))
    conn.execute("VACUUM ANALYZE outbox.floor_jobs")
    claim_sql, complete_sql = floor_sql(FLOOR_CLAIM), floor_sql(FLOOR_COMPLETE)
    params = {"limit": batch, "lease": 60.0, "worker": "cpu"}

    def complete(rows: list[Any]) -> None:
        conn.execute(complete_sql, {"ids": [r.id for r in rows],
                                    "versions": [r.claim_version for r in rows]}, prepare=True)

    return _drain(conn, lambda: conn.execute(claim_sql, params, prepare=True).fetchall(),
                  complete)


def measure(srv: Server, template: str, system: str, batch: int) -> Drained:
    """One drain by ``system`` on a fresh copy of ``template``."""
    name = f"cpu_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(srv.dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
            sql.Identifier(name), sql.Identifier(template)))
    try:
        with psycopg.connect(srv.database(name), autocommit=True,
                             row_factory=namedtuple_row) as conn:
            if system in VARIANTS:
                for statement in VARIANTS[system]:
                    conn.execute(statement)
                conn.execute("VACUUM ANALYZE outbox.jobs")
            if system == "outbox-settle":
                return _outbox(conn, batch, settle=True)
            if system == "outbox" or system in VARIANTS:
                return _outbox(conn, batch)
            return _floor(conn, batch, lease_index=system == "floor-indexed")
    finally:
        with psycopg.connect(srv.dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(name)))


ENQUEUE_BLOCK = 50
_PLAIN_SETUP = """
CREATE TABLE bench.plain (LIKE outbox.jobs INCLUDING DEFAULTS);
ALTER TABLE bench.plain ALTER id ADD GENERATED BY DEFAULT AS IDENTITY,
    ADD PRIMARY KEY (id), ADD UNIQUE (key);
"""
_PLAIN = ("INSERT INTO bench.plain (effect, key, payload, fingerprint, max_attempts) "
          "VALUES (%s, %s, %s, %s, %s)")


def enqueue_run(srv: Server, transactions: int) -> dict[str, dict[str, float]]:
    """One run of ``--enqueue`` in a fresh database: µs of the backend's CPU a
    transaction, in the job's statement and in the COMMIT, median over the run, for
    ``ours`` (tx.enqueue) and ``plain``."""
    import outbox

    from .enqueue import EFFECT, FINGERPRINT, ORDER, ORDERS_SETUP, email

    spent: dict[str, list[tuple[float, float]]] = {"ours": [], "plain": []}
    with fresh_database(srv, "statement_cpu") as dsn:
        migrated(dsn)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(ORDERS_SETUP + _PLAIN_SETUP)
            row = conn.execute("SELECT pg_backend_pid()").fetchone()
            assert row is not None
            pid = row[0]

            def one(variant: str, n: int) -> tuple[float, float]:
                with conn.transaction():
                    conn.execute(ORDER, (f"customer-{n}", 1999))
                    before = process_seconds(pid)
                    if variant == "ours":
                        outbox.transaction(conn).enqueue(
                            EFFECT, key=f"email-order-{n}", payload=email(n))
                    else:
                        conn.execute(_PLAIN, (EFFECT, f"email-order-{n}", Jsonb(email(n)),
                                              FINGERPRINT, 25))
                    statement = process_seconds(pid)
                commit = process_seconds(pid)
                return (statement - before) * 1e6, (commit - statement) * 1e6

            for n in range(2 * ENQUEUE_BLOCK):  # warm: prepared statements, caches
                one("ours" if n % 2 else "plain", -n - 1)
            n = 0
            while n < 2 * transactions:
                for variant, figures in spent.items():
                    for _ in range(ENQUEUE_BLOCK):
                        figures.append(one(variant, n))
                        n += 1
    return {variant: {"statement_us": statistics.median(s for s, _ in figures),
                      "commit_us": statistics.median(c for _, c in figures)}
            for variant, figures in spent.items()}


def enqueue_main(args: argparse.Namespace) -> None:
    """``--enqueue``: the job's statement and commit, ours against a plain INSERT."""
    load_before = os.getloadavg()
    started = time.time()
    with server(args.dsn) as srv:
        version = srv.version()
        runs = [enqueue_run(srv, args.transactions) for _ in range(args.runs)]
    lines = [f"server CPU of a business transaction's job (the statements' backend), "
             f"{args.transactions:,} transactions a variant, {args.runs} run(s): "
             "median (min..max) of the runs' medians, µs"]
    for part in ("statement_us", "commit_us"):
        ours = [r["ours"][part] for r in runs]
        plain = [r["plain"][part] for r in runs]
        ratio = [o / p for o, p in zip(ours, plain, strict=True)]
        lines.append(f"  {part[:-3]:9s} tx.enqueue {_figure(ours)}  plain INSERT "
                     f"{_figure(plain)}  ratio {_figure(ratio)}")
    both = [r["ours"]["statement_us"] + r["ours"]["commit_us"] for r in runs]
    base = [r["plain"]["statement_us"] + r["plain"]["commit_us"] for r in runs]
    lines.append(f"  both      tx.enqueue {_figure(both)}  plain INSERT {_figure(base)}  "
                 f"ratio {_figure([o / p for o, p in zip(both, base, strict=True)])}")
    print("\n".join(lines))
    out = args.out or Path("benchmarks/results") / (
        f"statement-cpu-enqueue-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": " ".join([sys.executable.rsplit("/", 1)[-1], "-m",
                             "benchmarks.statement_cpu", *sys.argv[1:]]),
        "timestamp": datetime.now(UTC).isoformat(), "seconds": time.time() - started,
        "postgresql": version, "cpus": os.cpu_count(),
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "transactions": args.transactions, "runs": runs, "summary": lines}, indent=2))
    print(f"written to {out}")


def _figure(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}..{max(values):.2f})"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.statement_cpu")
    parser.add_argument("--dsn", default=None)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=2_000)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--variants", action="store_true",
                        help="also our statements on other index layouts (VARIANTS)")
    parser.add_argument("--settle", action="store_true",
                        help="also the recorder's settle in place of the completion")
    parser.add_argument("--enqueue", action="store_true",
                        help="the business's enqueue statement against a plain INSERT")
    parser.add_argument("--transactions", type=int, default=2_000,
                        help="with --enqueue: transactions a variant and run")
    args = parser.parse_args(argv)
    if args.enqueue:
        enqueue_main(args)
        return
    load_before = os.getloadavg()
    started = time.time()
    systems = (SYSTEMS + (tuple(VARIANTS) if args.variants else ())
               + (("outbox-settle",) if args.settle else ()))
    runs: dict[str, list[Drained]] = {system: [] for system in systems}
    with server(args.dsn) as srv:
        version = srv.version()
        template = f"cpu_template_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(srv.dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(template)))
        try:
            migrated(srv.database(template))
            enqueue_outbox(srv.database(template), args.jobs)
            with psycopg.connect(srv.database(template), autocommit=True) as conn:
                conn.execute("VACUUM ANALYZE")
            for _ in range(args.runs):
                for system in systems:
                    drained = measure(srv, template, system, args.batch)
                    if drained.jobs != args.jobs:
                        raise AssertionError(f"{system} drained {drained.jobs} of {args.jobs}")
                    runs[system].append(drained)
        finally:
            with psycopg.connect(srv.dsn, autocommit=True) as admin:
                admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                    sql.Identifier(template)))
    per_job = {system: [(d.claim / d.jobs * 1e6, d.complete / d.jobs * 1e6) for d in drains]
               for system, drains in runs.items()}
    lines = [f"server CPU a job (the statements' backend), {args.jobs:,} jobs, batch "
             f"{args.batch:,}, {args.runs} run(s): median (min..max), µs"]
    for system, figures in per_job.items():
        totals = [c + k for c, k in figures]
        floor = [c + k for c, k in per_job["floor"]]
        lines.append(f"  {system:14s} claim {_figure([c for c, _ in figures])}  complete "
                     f"{_figure([k for _, k in figures])}  total {_figure(totals)}  "
                     f"/ floor {_figure([t / f for t, f in zip(totals, floor, strict=True)])}")
    print("\n".join(lines))
    out = args.out or Path("benchmarks/results") / (
        f"statement-cpu-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": " ".join([sys.executable.rsplit("/", 1)[-1], "-m",
                             "benchmarks.statement_cpu", *sys.argv[1:]]),
        "timestamp": datetime.now(UTC).isoformat(), "seconds": time.time() - started,
        "postgresql": version, "cpus": os.cpu_count(),
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "jobs": args.jobs, "batch": args.batch,
        "runs": {system: [{"claim_us": c, "complete_us": k} for c, k in figures]
                 for system, figures in per_job.items()},
        "summary": lines}, indent=2))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
