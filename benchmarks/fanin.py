"""Fan-in at scale (``after=[...]``): ``python -m benchmarks.fanin [--dsn DSN] [--runs 3]
[--size 40000]``. Starts an embedded PostgreSQL unless given ``--dsn``; each measurement in
a fresh database, every run alternating with its baseline; prints medians with their
min..max spread and the ratio to the baseline measured in the same run, and writes the raw
runs to ``benchmarks/results/fanin-<UTC timestamp>.json``.

- **many parents**: ``--size`` parents (no-op jobs, enqueued in batches of 1,000) and one
  child ``after`` all of them. The child's enqueue (the parents checked, the job written,
  the parents' states read, its edges linked: four statements); the drain of parents and
  child by one ``Dispatcher`` (the drain section's settings), against the drain of the
  same parents with no child; and the child's wait: its ledger row's time less the last
  parent's.
- **many children**: one parent and ``--size`` children ``after`` it (batches of 1,000),
  against the same batches without ``after``; the claim (the dispatcher's own statement,
  limit 100, 30 times, rolled back) of 1,000 due jobs of the children's own effect and
  group while the children wait, against the same claim with no child waiting; the
  parent's completion, releasing every child in its done transaction (the dispatcher's
  run for that one job), against a parent with no child; then the children's drain.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg

import outbox
from outbox.sql import queries

from ._db import Server, fresh_database, migrated, server, settle
from ._effects import NOOP, Noop
from ._stats import Figure, ratios

log = logging.getLogger("benchmarks")

CHILD = "bench.child"
BATCH = 1000
CLAIM_SAMPLES = 30
DUE_BESIDE = 1000  # due jobs of the children's effect the claim is timed against
OPTIONS: dict[str, Any] = {"concurrency": 64, "batch_size": 2000, "retention": 0,
                           "lease": 30.0}


class Child(Noop):
    name = CHILD


def _enqueue(dsn: str, jobs: Sequence[outbox.NewJob]) -> float:
    """Enqueue ``jobs`` in transactions of BATCH; the seconds it took."""
    started = time.perf_counter()
    with psycopg.connect(dsn) as conn:
        for at in range(0, len(jobs), BATCH):
            with outbox.transaction(conn) as tx:
                tx.enqueue_many(jobs[at:at + BATCH])
    return time.perf_counter() - started


def _drain(dsn: str, effects: list[outbox.Effect]) -> float:
    started = time.perf_counter()
    outbox.Dispatcher(dsn, effects, **OPTIONS).run_until_idle(timeout=600)
    return time.perf_counter() - started


def _parents(size: int, effect: str = NOOP, prefix: str = "p") -> list[outbox.NewJob]:
    return [outbox.NewJob(effect, key=f"{prefix}{i}", payload={}) for i in range(size)]


@contextmanager
def _database(srv: Server, label: str) -> Iterator[str]:
    with fresh_database(srv, label) as dsn:
        migrated(dsn)
        yield dsn


def many_parents(srv: Server, size: int) -> dict[str, float]:
    """One run of the many-parents case and its baseline."""
    with _database(srv, "fanin_parents") as dsn:
        parents = _parents(size)
        _enqueue(dsn, parents)
        started = time.perf_counter()
        with psycopg.connect(dsn) as conn, outbox.transaction(conn) as tx:
            tx.enqueue(CHILD, key="child", payload={}, after=[p.key for p in parents])
        child_enqueue = time.perf_counter() - started
        settle(dsn)
        drain = _drain(dsn, [Noop(), Child()])
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute(
                "SELECT date_part('epoch', max(r.recorded_at) FILTER (WHERE r.key = 'child')"
                " - max(r.recorded_at) FILTER (WHERE r.key <> 'child')), count(*)"
                " FROM outbox.effect_results r").fetchone()
        assert row is not None and row[1] == size + 1, row
        child_wait = float(row[0])
    with _database(srv, "fanin_parents_base") as dsn:
        _enqueue(dsn, _parents(size))
        settle(dsn)
        baseline = _drain(dsn, [Noop(), Child()])
    return {"child_enqueue": child_enqueue, "drain": drain, "drain_baseline": baseline,
            "child_wait": child_wait}


def _claim_seconds(dsn: str) -> float:
    """The median seconds of the dispatcher's claim (limit 100) of the children's effect,
    each in a transaction rolled back."""
    claim = queries("outbox").claim
    samples = []
    with psycopg.connect(dsn) as conn:
        for _ in range(CLAIM_SAMPLES):
            started = time.perf_counter()
            rows = conn.execute(claim, {"effects": [CHILD], "limit": 100, "lease": 30.0,
                                        "worker": "bench", "after": "{}"}).fetchall()
            samples.append(time.perf_counter() - started)
            conn.rollback()
            assert len(rows) == 100, len(rows)
    return statistics.median(samples)


def _completion(dsn: str) -> float:
    """The dispatcher's run for the one due parent (its claim, perform and done)."""
    return _drain(dsn, [Noop()])


def many_children(srv: Server, size: int) -> dict[str, float]:
    """One run of the many-children case and its baseline."""
    children = [outbox.NewJob(CHILD, key=f"c{i}", payload={}, after=["parent"])
                for i in range(size)]
    plain = [outbox.NewJob(CHILD, key=f"c{i}", payload={}) for i in range(size)]
    beside = _parents(DUE_BESIDE, CHILD, prefix="due")
    with _database(srv, "fanin_children") as dsn:
        _enqueue(dsn, [outbox.NewJob(NOOP, key="parent", payload={})])
        enqueue = _enqueue(dsn, children)
        _enqueue(dsn, beside)
        settle(dsn)
        claim = _claim_seconds(dsn)
        _drain(dsn, [Child()])  # the due jobs beside, out of the way
        completion = _completion(dsn)  # the parent, releasing every child
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute("SELECT count(*) FROM outbox.jobs WHERE after_waiting > 0"
                               ).fetchone()
        assert row == (0,), row
        drain = _drain(dsn, [Child()])
    with _database(srv, "fanin_children_base") as dsn:
        _enqueue(dsn, [outbox.NewJob(NOOP, key="parent", payload={})])
        enqueue_base = _enqueue(dsn, plain)
        with psycopg.connect(dsn, autocommit=True) as conn:  # timed; now out of the way
            conn.execute("DELETE FROM outbox.jobs WHERE effect = %s", (CHILD,))
        _enqueue(dsn, beside)
        settle(dsn)
        claim_base = _claim_seconds(dsn)
        _drain(dsn, [Child()])
        completion_base = _completion(dsn)
        _enqueue(dsn, [outbox.NewJob(CHILD, key=f"d{i}", payload={}) for i in range(size)])
        settle(dsn)
        drain_base = _drain(dsn, [Child()])
    return {"enqueue": enqueue, "enqueue_baseline": enqueue_base,
            "claim": claim, "claim_baseline": claim_base,
            "completion": completion, "completion_baseline": completion_base,
            "drain": drain, "drain_baseline": drain_base}


def _report(name: str, runs: list[dict[str, float]], pairs: Sequence[tuple[str, str, str]],
            alone: Sequence[tuple[str, str]]) -> list[str]:
    lines = [f"{name}:"]
    for label, measured, base in pairs:
        m = Figure.of([r[measured] for r in runs])
        b = Figure.of([r[base] for r in runs])
        ratio = ratios([r[measured] for r in runs], [r[base] for r in runs])
        lines.append(f"  {label:<44} {m.median:9.4f} s ({m.low:.4f}..{m.high:.4f})"
                     f"  baseline {b.median:9.4f} s ({b.low:.4f}..{b.high:.4f})"
                     f"  ratio {ratio.median:.2f} ({ratio.low:.2f}..{ratio.high:.2f})")
    for label, measured in alone:
        m = Figure.of([r[measured] for r in runs])
        lines.append(f"  {label:<44} {m.median:9.4f} s ({m.low:.4f}..{m.high:.4f})")
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fanin")
    parser.add_argument("--dsn", default=None)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--size", type=int, default=40_000)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    # The parent of the many-children case waits, on purpose, while a dispatcher of the
    # children's effect alone runs: its warning about an effect nobody serves is expected.
    logging.getLogger("outbox.dispatcher").setLevel(logging.ERROR)
    results: dict[str, list[dict[str, float]]] = {"many_parents": [], "many_children": []}
    cases: list[tuple[str, Callable[[Server, int], dict[str, float]]]] = [
        ("many_parents", many_parents), ("many_children", many_children)]
    load_before = os.getloadavg()
    started = time.time()
    with server(args.dsn) as srv:
        version = srv.version()
        for _ in range(args.runs):
            for name, case in cases:
                results[name].append(case(srv, args.size))
    lines = [f"fan-in, {args.size:,} parents / children, {args.runs} run(s): median "
             "(min..max), ratio to the baseline of the same run"]
    lines += _report("one child after every parent", results["many_parents"],
                     [("drain parents + child vs parents alone", "drain", "drain_baseline")],
                     [("the child's enqueue (check, insert, link)", "child_enqueue"),
                      ("last parent's ledger row -> the child's", "child_wait")])
    lines += _report("every child after one parent", results["many_children"],
                     [("enqueue of the children vs without after", "enqueue",
                       "enqueue_baseline"),
                      ("claim of 100 beside the waiting children", "claim", "claim_baseline"),
                      ("the parent's run, releasing every child", "completion",
                       "completion_baseline"),
                      ("the children's drain vs as many plain jobs", "drain",
                       "drain_baseline")], [])
    print("\n".join(lines))
    out = args.out or Path("benchmarks/results") / (
        f"fanin-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=False).stdout.strip() or None
    out.write_text(json.dumps({
        "command": " ".join([sys.executable.rsplit("/", 1)[-1], "-m", "benchmarks.fanin",
                             *sys.argv[1:]]),
        "timestamp": datetime.now(UTC).isoformat(), "seconds": time.time() - started,
        "commit": commit, "postgresql": version, "cpus": os.cpu_count(),
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "size": args.size, "runs": results, "summary": lines}, indent=2))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
