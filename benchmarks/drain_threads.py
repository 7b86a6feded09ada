"""The dispatcher's own CPU a job, thread by thread, over a no-op drain in this process.

``python -m benchmarks.drain_threads [--dsn DSN] [--runs 3] [--jobs 20000] [--gc-freeze]``
enqueues ``--jobs`` no-op jobs in a fresh database per run and drains them with one
``Dispatcher`` (the drain section's settings, ``cli.BEST_OUTBOX``) in this very process,
reading each thread's CPU time (``time.thread_time()``) as it ends, and the caller's
(the claimer's) around ``run_until_idle``: what each part of the dispatcher spends a job,
in µs, which the drain section's process-wide figure does not split. With
``--gc-freeze`` the process calls ``gc.freeze()`` before each drain (what it holds then
is left out of the cyclic collector's passes). The runs go to
``benchmarks/results/drain-threads-<UTC timestamp>.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import outbox

from ._db import fresh_database, migrated, server, settle
from ._drain_workers import _dispatcher
from ._seed import enqueue_outbox
from .cli import BEST_OUTBOX

CLAIMER = "claimer (the caller's thread)"


@contextmanager
def threads_timed(cpu: dict[str, float]) -> Iterator[None]:
    """Add each thread's CPU seconds, as it ends, to ``cpu`` under its part's name (the
    worker threads under one)."""
    run = threading.Thread.run

    def timed(self: threading.Thread) -> None:
        try:
            run(self)
        finally:
            part = "workers" if self.name.startswith("outbox-worker") else self.name
            cpu[part] = cpu.get(part, 0.0) + time.thread_time()

    threading.Thread.run = timed  # type: ignore[method-assign]
    try:
        yield
    finally:
        threading.Thread.run = run  # type: ignore[method-assign]


def drain(dispatcher: outbox.Dispatcher, jobs: int) -> dict[str, float]:
    """One drain's µs a job, by part, and the process's."""
    cpu: dict[str, float] = {}
    with threads_timed(cpu):
        process, caller, started = time.process_time(), time.thread_time(), time.perf_counter()
        stats = dispatcher.run_until_idle(timeout=60 + jobs / 100)
        seconds = time.perf_counter() - started
        cpu[CLAIMER] = time.thread_time() - caller
        cpu["process"] = time.process_time() - process
    if stats.done != jobs:
        raise AssertionError(f"drained {stats.done} of {jobs}")
    figures = {part: spent / jobs * 1e6 for part, spent in cpu.items()}
    return {**figures, "jobs_per_second": jobs / seconds}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.drain_threads")
    parser.add_argument("--dsn", default=None)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--gc-freeze", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    runs: list[dict[str, float]] = []
    with server(args.dsn) as srv:
        for _ in range(args.runs):
            with fresh_database(srv, "threads") as dsn:
                migrated(dsn)
                enqueue_outbox(dsn, args.jobs)
                settle(dsn)
                dispatcher = _dispatcher(dsn, BEST_OUTBOX)
                if args.gc_freeze:
                    gc.freeze()
                runs.append(drain(dispatcher, args.jobs))
    parts = sorted({p for r in runs for p in r} - {"jobs_per_second"},
                   key=lambda p: -statistics.median(r.get(p, 0.0) for r in runs))
    lines = [f"{args.jobs:,} no-op jobs, one process, {args.runs} run(s)"
             f"{', gc.freeze()' if args.gc_freeze else ''}: CPU µs a job, median (min..max)"]
    for part in parts:
        values = [r.get(part, 0.0) for r in runs]
        lines.append(f"  {part:32s} {statistics.median(values):9.2f} "
                     f"({min(values):.2f}..{max(values):.2f})")
    rates = [r["jobs_per_second"] for r in runs]
    lines.append(f"  jobs/s (a loaded machine's, noisy) {statistics.median(rates):,.0f} "
                 f"({min(rates):,.0f}..{max(rates):,.0f})")
    print("\n".join(lines))
    out = args.out or Path("benchmarks/results") / (
        f"drain-threads-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": " ".join([sys.executable.rsplit("/", 1)[-1], "-m",
                             "benchmarks.drain_threads", *sys.argv[1:]]),
        "timestamp": datetime.now(UTC).isoformat(), "cpus": os.cpu_count(),
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "settings": BEST_OUTBOX.describe(), "gc_freeze": args.gc_freeze,
        "runs": runs, "summary": lines}, indent=2))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
