"""Section graphile: our drain against Graphile Worker tuned, one process each, on the
same server, alternating in the same run.

Graphile Worker (Node.js, pinned in ``peers/graphile/package.json`` and its lock file)
is installed once with ``npm ci`` into a cache directory outside the repository
(``$OUTBOX_BENCH_CACHE``, else ``$XDG_CACHE_HOME/outbox-benchmarks``, else
``~/.cache/outbox-benchmarks``), in a directory named after the hash of those two files.
Each run of it: a fresh database, its schema and N no-op jobs added with its bulk
``addJobs`` (``peers/graphile/drain.js seed``), VACUUM ANALYZE and a CHECKPOINT, then one
Node process (``drain.js drain``) that builds its options, opens its pool's connections
and says it is ready; the clock starts when it is released (a line on its stdin) and stops
when it reports that ``runOnce`` returned (every job performed and its completion
committed). Ours is the drain section's ``outbox-gc-frozen`` (one ``Dispatcher`` process,
``run_until_idle``, ``gc.freeze()`` before the release, as ``outbox run`` does).

Graphile Worker's throughput settings are preset options (``preset.worker``):
``localQueue``, ``completeJobBatchDelay`` and ``failJobBatchDelay`` given at the top level
of ``run()``'s options are not options at all, and are dropped with a console warning, so
a harness passing them there measures the defaults (about 1,200 to 2,000 jobs/s here).
``drain.js`` passes them in ``preset`` and reports the local queue's fetches, which the
section checks: a tuned run that fetched nothing in batches did not apply its settings.

``python -m benchmarks.graphile --sweep`` drains with each of a grid of Graphile Worker
settings, interleaved, and prints each one's rate and CPU a job: how ``TUNED`` was chosen.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

from . import drain
from ._cpu import ServerCpu, wait_for_clients_to_leave
from ._db import Server, fresh_database, scalar, server, settle
from ._drain_workers import OutboxSettings
from ._graphile import (
    DRIVER,
    TUNED,
    UNTUNED,
    VERSION,
    GraphileError,
    GraphileSettings,
    check_drain,
    environment,
    install,
    missing_tools,
    parse_report,
    read_line,
    seed,
)
from ._results import Row, Section, Target
from ._stats import Figure, ratios

log = logging.getLogger("benchmarks.graphile")
RESULTS = Path(__file__).resolve().parent / "results"

OURS = "outbox-gc-frozen"
THEIRS = "graphile"
# The target: our drain at least 1.5 times Graphile Worker's, tuned.
TARGET = Target(">=", 1.5)


def tuned(options: Sequence[tuple[str, Any]] = ()) -> GraphileSettings:
    """The tuned settings with ``(name, value)`` pairs replacing some (``--graphile-option``);
    ValueError or TypeError for a name or value that is not one of them."""
    return TUNED.with_options(options)


@dataclass(frozen=True)
class GraphileConfig:
    runs: int
    sizes: tuple[int, ...] = (20_000, 100_000)
    outbox: OutboxSettings = field(default_factory=OutboxSettings)
    graphile: GraphileSettings = TUNED
    cache: Path | None = None

    def timeout(self, jobs: int) -> float:
        return 60.0 + jobs / 100


def measure(srv: Server, config: GraphileConfig, jobs: int, modules: Path,
            settings: GraphileSettings | None = None) -> drain.DrainRun:
    """One drain of ``jobs`` by one Graphile Worker process in a fresh database."""
    settings = settings or config.graphile
    timeout = config.timeout(jobs)
    with fresh_database(srv, THEIRS) as dsn:
        enqueue_rate = seed(dsn, jobs, modules, timeout)
        settle(dsn)
        server_cpu = ServerCpu.of(dsn)
        # Its stderr to a file, read once it has exited: a pipe nobody reads could fill.
        with tempfile.TemporaryFile() as errors:
            proc = subprocess.Popen(
                ["node", str(DRIVER), "drain", str(jobs), settings.as_json()],
                env=environment(dsn, modules), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=errors)
            try:
                assert proc.stdin is not None
                deadline = time.monotonic() + timeout
                ready = read_line(proc, deadline)
                before = server_cpu.seconds() if server_cpu else 0.0
                started = time.perf_counter()
                if ready:
                    proc.stdin.write(b"go\n")
                    proc.stdin.flush()
                line = read_line(proc, deadline) if ready else b""
                seconds = time.perf_counter() - started
                proc.stdin.close()
                proc.wait(max(1.0, deadline - time.monotonic()))
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                errors.seek(0)
                stderr = errors.read().decode(errors="replace")
        if proc.returncode != 0 or not ready:
            raise GraphileError(f"graphile drain failed (exit {proc.returncode}):\n"
                                f"{stderr[-2000:]}")
        parse_report(ready, "ready")
        report = parse_report(line, "done")
        check_drain(report, jobs, settings)
        if stderr.strip():
            log.warning("graphile-worker said: %s", stderr.strip()[:1000])
        report["stderr"] = stderr
        server_seconds = None
        if server_cpu is not None:
            wait_for_clients_to_leave(dsn)
            server_seconds = server_cpu.seconds() - before
        left = scalar(dsn, "SELECT count(*) FROM graphile_worker._private_jobs")
        if left != 0:
            rows = scalar(dsn, "SELECT json_agg(j) FROM (SELECT id, attempts, locked_by, "
                          "locked_at, last_error FROM graphile_worker._private_jobs "
                          "LIMIT 5) j")
            raise GraphileError(f"graphile drain: {left} of {jobs} jobs left in the table "
                                f"after it returned ({settings.describe()}); report "
                                f"{ {k: v for k, v in report.items() if k != 'stderr'} }, "
                                f"some: {rows}")
    run = drain.DrainRun(THEIRS, jobs, 1, seconds, jobs / seconds, enqueue_rate, [report],
                         float(report["cpu_seconds"]), server_seconds)
    cpu = run.cpu_per_job()
    log.info("graphile %d jobs: %.0f jobs/s%s", jobs, run.jobs_per_second,
             f", CPU {cpu[0]:.1f} us/job server + {cpu[1]:.1f} client" if cpu else "")
    return run


# -- the section ---------------------------------------------------------------------------

def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _label(jobs: int) -> str:
    return f"{jobs // 1000}k" if jobs % 1000 == 0 else str(jobs)


def _rows(config: GraphileConfig, results: list[drain.DrainRun],
          loads: dict[int, list[float | None]]) -> list[Row]:
    rows: list[Row] = []
    for size in config.sizes:
        ours = [r for r in results if r.system == OURS and r.jobs == size]
        theirs = [r for r in results if r.system == THEIRS and r.jobs == size]
        mine, other = [r.jobs_per_second for r in ours], [r.jobs_per_second for r in theirs]
        label = _label(size)
        seen = [x for x in loads.get(size, []) if x is not None]
        load = f"load {min(seen):.1f}..{max(seen):.1f}" if seen else ""
        rows.append(Row(THEIRS, f"{THEIRS} {label} x1", "jobs/s", Figure.of(other)))
        rows.append(Row(THEIRS, f"{OURS} {label} x1", "jobs/s", Figure.of(mine)))
        rows.append(Row(THEIRS, f"outbox vs graphile {label} x1", "jobs/s", Figure.of(mine),
                        "graphile-worker tuned", Figure.of(other), ratios(mine, other),
                        TARGET, note=load))
        cpu_ours = [c for c in (r.cpu_per_job() for r in ours) if c is not None]
        cpu_theirs = [c for c in (r.cpu_per_job() for r in theirs) if c is not None]
        if len(cpu_ours) == len(ours) and len(cpu_theirs) == len(theirs) and ours:
            total_ours = [s + c for s, c in cpu_ours]
            total_theirs = [s + c for s, c in cpu_theirs]
            split = (f"ours server {Figure.of([s for s, _ in cpu_ours]).median:.1f} + client "
                     f"{Figure.of([c for _, c in cpu_ours]).median:.1f}; graphile server "
                     f"{Figure.of([s for s, _ in cpu_theirs]).median:.1f} + client "
                     f"{Figure.of([c for _, c in cpu_theirs]).median:.1f}")
            rows.append(Row(THEIRS, f"outbox CPU {label} x1", "us/job", Figure.of(total_ours),
                            "graphile CPU (its / ours)", Figure.of(total_theirs),
                            ratios(total_theirs, total_ours), note=split))
    return rows


def _skipped(why: str, config: GraphileConfig) -> Section:
    log.warning("graphile section skipped: %s", why)
    rows = [Row(THEIRS, f"outbox vs graphile {_label(size)} x1", "jobs/s", Figure.of([]),
                note=f"skipped: {why}") for size in config.sizes]
    return Section(THEIRS, rows, raw={"skipped": why})


def run(srv: Server, config: GraphileConfig) -> Section:
    """Ours and Graphile Worker tuned at each size, ``config.runs`` times, alternating."""
    why = missing_tools()
    if why is not None:
        return _skipped(why, config)
    try:
        modules = install(config.cache)
    except (GraphileError, OSError, subprocess.SubprocessError) as e:
        # No registry reachable, say: the other sections' figures still count.
        return _skipped(f"graphile-worker {VERSION} could not be installed: {e}", config)
    ours = drain.DrainConfig(sizes=config.sizes, procs=(1,), runs=1, systems=(OURS,),
                             outbox=config.outbox)
    results: list[drain.DrainRun] = []
    loads: dict[int, list[float | None]] = {}
    for i in range(config.runs):
        for size in config.sizes:
            loads.setdefault(size, []).append(_load())
            pair: list[Callable[[], drain.DrainRun]] = [
                partial(drain.measure, srv, ours, OURS, size, 1),
                partial(measure, srv, config, size, modules)]
            # Ours first in even runs, theirs first in odd ones: drift favours neither.
            for one in pair if i % 2 == 0 else pair[::-1]:
                results.append(one())
            log.info("graphile section: run %d at %d jobs done", i + 1, size)
    settings = {OURS: f"{config.outbox.describe()}, 1 process, gc.freeze() before release",
                THEIRS: f"graphile-worker {VERSION} runOnce, 1 process, "
                        f"{config.graphile.describe()}"}
    return Section(THEIRS, _rows(config, results, loads),
                   raw={"config": asdict(config), "loads": loads,
                        "runs": [asdict(r) for r in results]},
                   settings=settings)


# -- the sweep (a script of its own) -----------------------------------------------------

def grid() -> list[GraphileSettings]:
    """The settings the sweep tries: the docs' recommendations and their neighbours."""
    base = TUNED
    variants = [UNTUNED, replace(UNTUNED, local_queue=500),
                replace(base, complete_batch_delay=-1, fail_batch_delay=-1)]
    variants += [replace(base, local_queue=size) for size in (100, 500, 1000, 2000, 5000, 10_000)]
    variants += [replace(base, concurrency=c, pool=c + 1) for c in (4, 10, 64)]
    variants += [replace(base, pool=4), replace(base, complete_batch_delay=1,
                                                fail_batch_delay=1),
                 replace(base, refetch_delay_ms=10), replace(base, prepared_statements=False)]
    unique: list[GraphileSettings] = []
    for variant in variants:
        if variant not in unique:
            unique.append(variant)
    return unique


def sweep(srv: Server, config: GraphileConfig, variants: Sequence[GraphileSettings]
          ) -> list[tuple[GraphileSettings, list[drain.DrainRun]]]:
    """Each variant drained ``config.runs`` times at each size, interleaved."""
    modules = install(config.cache)
    found: dict[int, list[drain.DrainRun]] = {i: [] for i in range(len(variants))}
    for _ in range(config.runs):
        for size in config.sizes:
            for i, variant in enumerate(variants):
                try:
                    found[i].append(measure(srv, config, size, modules, variant))
                except GraphileError as e:
                    log.warning("%s", e)
    return [(variant, found[i]) for i, variant in enumerate(variants)]


def _sweep_main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.graphile",
                                description="Graphile Worker's drain with a grid of its "
                                "settings, interleaved: rate and CPU a job of each.")
    p.add_argument("--sweep", action="store_true", required=True)
    p.add_argument("--dsn")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--jobs", type=int, default=20_000)
    p.add_argument("--local-queues", help="only the tuned settings with each of these "
                   "local queue sizes, e.g. 1000,2000,5000 (default: the whole grid)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    why = missing_tools()
    if why is not None:
        print(f"skipped: {why}")
        return 0
    config = GraphileConfig(runs=args.runs, sizes=(args.jobs,))
    started, load_before = datetime.now(UTC), _load()
    with server(args.dsn) as srv:
        variants = ([replace(TUNED, local_queue=int(size))
                     for size in args.local_queues.split(",")]
                    if args.local_queues else grid())
        found = sweep(srv, config, variants)
    print(f"graphile-worker {VERSION}, {args.jobs} jobs, {args.runs} runs each, "
          f"load {load_before} -> {_load()}")
    print(f"{'jobs/s median (min..max)':>28}  {'CPU us/job server+client':>26}  settings")
    for variant, drained in sorted(found, key=lambda f: -statistics.median(
            [r.jobs_per_second for r in f[1]] or [0.0])):
        rates = [r.jobs_per_second for r in drained] or [float("nan")]
        if len(drained) < args.runs:
            print(f"  ({args.runs - len(drained)} run(s) failed, see the warnings above)")
        cpus = [c for c in (r.cpu_per_job() for r in drained) if c is not None]
        cpu = (f"{statistics.median(s for s, _ in cpus):.1f} + "
               f"{statistics.median(c for _, c in cpus):.1f}") if cpus else "-"
        print(f"{statistics.median(rates):>10,.0f} ({min(rates):,.0f}..{max(rates):,.0f})"
              f"  {cpu:>26}  {variant.describe()}")
    out = RESULTS / f"graphile-sweep-{started.strftime('%Y%m%dT%H%M%SZ')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "timestamp": started.isoformat(), "argv": list(argv if argv is not None
                                                       else sys.argv[1:]),
        "version": VERSION, "load": {"before": load_before, "after": _load()},
        "variants": [{"settings": asdict(variant), "runs": [asdict(r) for r in drained]}
                     for variant, drained in found]}, indent=2, default=str) + "\n")
    print(f"runs written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(_sweep_main())
