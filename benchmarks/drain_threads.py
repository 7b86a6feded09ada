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

``--small [--rounds 30] [--small-jobs 10] [--concurrency 16] [--against DIR]`` times
what a small, cron-style drain pays instead: ``run_until_idle`` over ``--small-jobs``
no-op jobs, and over none (wall clock, process CPU, worker threads started), round
after round of one dispatcher in a process of its own (``_small_drain.py``). With
``--against``, a second such process imports ``outbox`` from ``DIR``, another checkout
(e.g. ``git archive <commit> | tar -x -C DIR``), in a schema of its own in the same
database; the two alternate in every round (which goes first swaps each round), after 3
rounds each not counted. Prints the median with the quartiles and min..max of each, and
ours over the baseline's (``--against``): the ratio of the medians, and the median of
each round's ratio (its pair ran back to back); writes
``benchmarks/results/drain-small-<UTC timestamp>.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
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
from ._stats import percentile
from .cli import BEST_OUTBOX, _source

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


SIDE = Path(__file__).with_name("_small_drain.py")  # one side of --small, as a script
WARM_ROUNDS = 3  # rounds each side runs first, not counted (connections, imports, caches)


class Side:
    """A ``_small_drain.py`` process importing ``outbox`` from ``tree``."""

    def __init__(self, name: str, tree: Path, dsn: str, concurrency: int) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, str(SIDE), dsn, name, str(concurrency)],
            env={**os.environ, "PYTHONPATH": str(tree)}, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True)
        ready = self.readline().strip().split(maxsplit=1)
        if ready[:1] != ["ready"] or not Path(ready[1]).is_relative_to(tree):
            raise RuntimeError(f"{name}: imported outbox from {ready[1:]}, not {tree}")
        self.outbox = ready[1]

    def readline(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} ended (exit code {self.proc.wait()})")
        return line

    def drain(self, jobs: int) -> tuple[float, float, int]:
        """Wall and process CPU seconds of one ``run_until_idle`` over ``jobs`` jobs, and
        the worker threads it started."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{jobs}\n")
        self.proc.stdin.flush()
        wall, cpu, threads = self.readline().split()
        return float(wall), float(cpu), int(threads)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(60)


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "p25": percentile(values, 0.25),
            "p75": percentile(values, 0.75), "min": min(values), "max": max(values)}


def small(args: argparse.Namespace) -> None:
    """``--small``: short drains, this checkout against ``--against``'s, alternating."""
    load_before = os.getloadavg()
    trees = {"ours": Path(__file__).resolve().parent.parent}
    if args.against is not None:
        trees["base"] = args.against.resolve()
    sizes = (args.small_jobs, 0)
    seconds: dict[str, dict[int, dict[str, list[float]]]] = {
        side: {n: {"wall": [], "cpu": [], "threads": []} for n in sizes} for side in trees}
    with server(args.dsn) as srv, fresh_database(srv, "small") as dsn:
        sides = [Side(name, tree, dsn, args.concurrency) for name, tree in trees.items()]
        try:
            for number in range(WARM_ROUNDS + args.rounds):
                order = sides if number % 2 == 0 else sides[::-1]
                for jobs in sizes:
                    for side in order:
                        wall, cpu, threads = side.drain(jobs)
                        if number >= WARM_ROUNDS:
                            seconds[side.name][jobs]["wall"].append(wall)
                            seconds[side.name][jobs]["cpu"].append(cpu)
                            seconds[side.name][jobs]["threads"].append(threads)
        finally:
            for side in sides:
                side.close()
    lines = [f"run_until_idle of one Dispatcher (concurrency {args.concurrency}), "
             f"{args.rounds} rounds a side{', alternating' if len(sides) > 1 else ''}: "
             "ms, median (p25..p75; min..max)"]
    summary: dict[str, object] = {}
    for jobs in sizes:
        for measure in ("wall", "cpu"):
            for side in sides:
                figure = spread(seconds[side.name][jobs][measure])
                summary[f"{side.name} {jobs} jobs {measure}"] = figure
                lines.append(
                    f"  {jobs:3d} jobs {measure:4s} {side.name:5s} "
                    f"{figure['median'] * 1e3:8.3f} ({figure['p25'] * 1e3:.3f}.."
                    f"{figure['p75'] * 1e3:.3f}; {figure['min'] * 1e3:.3f}.."
                    f"{figure['max'] * 1e3:.3f})")
            if len(sides) > 1:
                ours, base = (seconds[s][jobs][measure] for s in ("ours", "base"))
                # Each round's pair ran back to back: its ratio cancels slower drift.
                paired = spread([o / b for o, b in zip(ours, base, strict=True)])
                summary[f"{jobs} jobs {measure} paired ours / base"] = paired
                lines.append(
                    f"  {jobs:3d} jobs {measure:4s} ours / base: of the medians "
                    f"{statistics.median(ours) / statistics.median(base):.3f}, paired "
                    f"{paired['median']:.3f} ({paired['p25']:.3f}..{paired['p75']:.3f})")
        for side in sides:
            started = seconds[side.name][jobs]["threads"]
            lines.append(f"  {jobs:3d} jobs worker threads started, {side.name:5s} "
                         f"median {statistics.median(started):g} "
                         f"({min(started):g}..{max(started):g})")
    print("\n".join(lines))
    out = args.out or Path("benchmarks/results") / (
        f"drain-small-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": " ".join([sys.executable.rsplit("/", 1)[-1], "-m",
                             "benchmarks.drain_threads", *sys.argv[1:]]),
        "timestamp": datetime.now(UTC).isoformat(), "cpus": os.cpu_count(),
        "load_average": {"before": load_before, "after": os.getloadavg()},
        # Ours: this checkout's commit; the baseline: the directory given.
        "source": {"ours": _source(), **({"base": str(args.against)} if args.against else {})},
        "concurrency": args.concurrency, "rounds": args.rounds,
        "seconds": seconds, "figures": summary, "summary": lines}, indent=2))
    print(f"written to {out}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.drain_threads")
    parser.add_argument("--dsn", default=None)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--gc-freeze", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--small", action="store_true",
                        help="time small drains (and empty ones) instead")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--small-jobs", type=int, default=10)
    parser.add_argument("--concurrency", type=int, default=16,
                        help="the small drains' Dispatcher concurrency (its default: 16)")
    parser.add_argument("--against", type=Path, default=None, metavar="DIR",
                        help="another checkout whose outbox the small drains alternate with")
    args = parser.parse_args(argv)
    if args.small:
        small(args)
        return
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
