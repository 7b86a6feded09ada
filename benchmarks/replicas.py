"""What ``wait_for_replicas=True`` costs, against the same dispatcher without it, on a
primary with one asynchronous streaming standby (both on this machine, TCP on 127.0.0.1,
made by the failover tests' helper: ``initdb``, ``pg_basebackup -R``).

    drain     jobs/s of ``Dispatcher.run_until_idle`` over N pending no-op jobs
    latency   commit of an enqueue -> start of its ``perform`` in an idle dispatcher in
              ``run()`` (woken by NOTIFY), one job at a time at random gaps: p50, p99

Runs alternate off / on; each figure is the median of ``--runs`` runs with its min..max,
and the ratio the median of the per-run ratios (run i on against run i off). The raw
runs go to ``benchmarks/results/replicas-<UTC>.json`` (``--out`` to choose).

    python -m benchmarks.replicas                  # 3 runs, 5000 jobs, 200 samples
    python -m benchmarks.replicas --runs 5 --jobs 20000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from psycopg import sql

import outbox
from outbox import Dispatcher, Effect, Job

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.failover.support import Pair, pair

RESULTS = Path(__file__).resolve().parent / "results"


class Noop(Effect):
    name = "bench.noop"

    def perform(self, job: Job) -> None:
        return None


class Stamped(Effect):
    """Records when each job's perform started, by key."""

    name = "bench.stamped"

    def __init__(self) -> None:
        self.started: dict[str, float] = {}
        self.event = threading.Event()

    def perform(self, job: Job) -> None:
        self.started[job.key] = time.perf_counter()
        self.event.set()


def _schema(servers: Pair, name: str) -> str:
    with servers.primary.connect() as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))
        outbox.migrate(conn, schema=name)
    return name


def drain(servers: Pair, jobs: int, wait: bool, run: int) -> float:
    schema = _schema(servers, f"drain_{'on' if wait else 'off'}_{run}")
    with servers.primary.connect() as conn, conn.transaction(), \
            outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue_many(outbox.NewJob("bench.noop", key=f"k-{n}", payload={})
                        for n in range(jobs))
    servers.wait_replayed()
    dispatcher = Dispatcher(servers.primary.dsn, effects=[Noop()], schema=schema,
                            wait_for_replicas=wait, retention=0)
    started = time.perf_counter()
    stats = dispatcher.run_until_idle(timeout=600)
    elapsed = time.perf_counter() - started
    assert stats.done == jobs, (stats.done, jobs)
    return jobs / elapsed


def latency(servers: Pair, samples: int, wait: bool, run: int) -> list[float]:
    schema = _schema(servers, f"latency_{'on' if wait else 'off'}_{run}")
    effect = Stamped()
    dispatcher = Dispatcher(servers.primary.dsn, effects=[effect], schema=schema,
                            wait_for_replicas=wait, poll_interval=5.0)
    runner = threading.Thread(target=dispatcher.run)
    runner.start()
    seconds: list[float] = []
    try:
        with servers.primary.connect() as conn:
            time.sleep(0.5)  # the listener is listening
            for n in range(samples):
                key = f"l-{n}"
                effect.event.clear()
                with conn.transaction(), outbox.transaction(conn, schema=schema) as tx:
                    tx.enqueue("bench.stamped", key=key, payload={})
                committed = time.perf_counter()
                if not effect.event.wait(30):
                    raise RuntimeError(f"job {key} was not performed in 30 s")
                seconds.append(effect.started[key] - committed)
                time.sleep(random.uniform(0.005, 0.03))
    finally:
        dispatcher.stop()
        runner.join(60)
    return seconds


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    raw: dict[str, Any] = {"drain": {"off": [], "on": []},
                           "latency": {"off": [], "on": []}}
    with pair() as servers:
        for run in range(args.runs):
            for wait in (False, True):
                key = "on" if wait else "off"
                raw["drain"][key].append(drain(servers, args.jobs, wait, run))
                raw["latency"][key].append(latency(servers, args.samples, wait, run))
    drain_ratio = [on / off for on, off in zip(raw["drain"]["on"], raw["drain"]["off"],
                                               strict=True)]
    summary: dict[str, Any] = {
        "drain_jobs_per_s": {k: _spread(v) for k, v in raw["drain"].items()},
        "drain_ratio_on_to_off": _spread(drain_ratio),
    }
    for name, share in (("p50", 0.5), ("p99", 0.99)):
        per_run = {k: [_percentile(s, share) * 1000 for s in v]
                   for k, v in raw["latency"].items()}
        summary[f"latency_{name}_ms"] = {k: _spread(v) for k, v in per_run.items()}
        summary[f"latency_{name}_ratio_on_to_off"] = _spread(
            [on / off for on, off in zip(per_run["on"], per_run["off"], strict=True)])
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=False).stdout.strip()
    out = args.out or RESULTS / f"replicas-{datetime.now(UTC):%Y%m%dT%H%M%SZ}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": " ".join(["python -m benchmarks.replicas", *(argv or sys.argv[1:])]),
        "commit": commit, "load_average": os.getloadavg(), "runs": args.runs,
        "jobs": args.jobs, "samples": args.samples, "summary": summary, "raw": raw},
        indent=1))
    for name, figure in summary.items():
        shown = ({"": figure} if "ratio" in name else figure).items()
        print(f"{name:34}" + "  ".join(
            f"{k + ': ' if k else ''}{v['median']:.3f} ({v['min']:.3f}..{v['max']:.3f})"
            for k, v in shown))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
