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
import hashlib
import json
import logging
import os
import select
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from psycopg.conninfo import conninfo_to_dict

from . import drain
from ._cpu import ServerCpu, wait_for_clients_to_leave
from ._db import Server, fresh_database, scalar, server, settle
from ._drain_workers import OutboxSettings
from ._results import Row, Section, Target
from ._stats import Figure, ratios

log = logging.getLogger("benchmarks.graphile")

PEER = Path(__file__).resolve().parent / "peers" / "graphile"
DRIVER = PEER / "drain.js"
PACKAGE_FILES = ("package.json", "package-lock.json")
VERSION = "0.17.3"
OURS = "outbox-gc-frozen"
THEIRS = "graphile"
# The target: our drain at least 1.5 times Graphile Worker's, tuned.
TARGET = Target(">=", 1.5)
INSTALL_HINT = ("install Node.js (18 or later) and npm, e.g. `apt-get install nodejs npm` "
                "on Debian, or from https://nodejs.org/, then run this section again")


class GraphileError(RuntimeError):
    """Graphile Worker's driver failed, said something unreadable, or drained wrongly."""


@dataclass(frozen=True)
class GraphileSettings:
    """Graphile Worker's options for the drain, each a ``preset.worker`` option:
    ``concurrency`` (``concurrentJobs``), ``pool`` (the connections of the ``pg`` pool
    given to it, its ``maxPoolSize``), ``local_queue`` (``localQueue.size``: jobs fetched
    per query and handed out locally; -1 off), ``refetch_delay_ms``
    (``localQueue.refetchDelay.durationMs``; None: none), ``complete_batch_delay`` and
    ``fail_batch_delay`` (``completeJobBatchDelay`` / ``failJobBatchDelay``, ms: completions
    batched into one statement; -1 off, 0 the next tick), ``prepared_statements``."""

    concurrency: int = 24
    pool: int = 25
    local_queue: int = 2000
    refetch_delay_ms: int | None = None
    complete_batch_delay: int = 0
    fail_batch_delay: int = 0
    prepared_statements: bool = True

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.pool < 1:
            raise ValueError(f"graphile: concurrency and pool must be at least 1, got "
                             f"concurrency={self.concurrency} pool={self.pool}")
        if self.local_queue == 0 or self.local_queue < -1:
            raise ValueError(f"graphile: local_queue must be -1 (off) or at least 1, "
                             f"got {self.local_queue}")

    def as_json(self) -> str:
        """The settings as ``drain.js drain`` reads them."""
        return json.dumps(asdict(self), sort_keys=True)

    def describe(self) -> str:
        return " ".join(f"{k}={v}" for k, v in asdict(self).items())

    def with_options(self, options: Sequence[tuple[str, Any]]) -> GraphileSettings:
        """These settings with ``(name, value)`` pairs replacing some; a clear error for
        a name that is not one of them."""
        known = set(asdict(self))
        unknown = [name for name, _ in options if name not in known]
        if unknown:
            raise ValueError(f"graphile: unknown setting(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        return replace(self, **dict(options))


# The settings Graphile Worker's performance page recommends for throughput (a local
# queue, completions and failures batched at delay 0, concurrency 24 with a pool of 25),
# with the local queue's size chosen by `--sweep` on this machine.
TUNED = GraphileSettings()
# Its defaults for fetching and completing (no local queue: a query per job fetched; no
# batching: a statement per job completed) at the tuned concurrency and pool.
UNTUNED = GraphileSettings(local_queue=-1, complete_batch_delay=-1, fail_batch_delay=-1)


@dataclass(frozen=True)
class GraphileConfig:
    runs: int
    sizes: tuple[int, ...] = (20_000, 100_000)
    outbox: OutboxSettings = field(default_factory=OutboxSettings)
    graphile: GraphileSettings = TUNED
    cache: Path | None = None

    def timeout(self, jobs: int) -> float:
        return 60.0 + jobs / 100


# -- the driver's output ---------------------------------------------------------------

def parse_report(line: str | bytes, expected: str) -> dict[str, Any]:
    """One line the driver printed: a JSON object holding ``expected`` (``ready``,
    ``done`` or ``seeded``); a GraphileError saying what was wrong otherwise."""
    text = line.decode(errors="replace") if isinstance(line, bytes) else line
    text = text.strip()
    if not text:
        raise GraphileError(f"graphile driver: expected a {expected!r} report, got nothing "
                            "(did it exit?)")
    try:
        report = json.loads(text)
    except json.JSONDecodeError as e:
        raise GraphileError(f"graphile driver: expected a JSON {expected!r} report, got "
                            f"{text[:200]!r} ({e.msg} at column {e.colno})") from None
    if not isinstance(report, dict) or expected not in report:
        raise GraphileError(f"graphile driver: expected a {expected!r} report, got "
                            f"{text[:200]!r}")
    return report


def check_drain(report: dict[str, Any], jobs: int, settings: GraphileSettings) -> None:
    """A drain report must account for every job, and a local queue that was asked for
    must have fetched in batches (else its settings were not applied)."""
    for name in ("performed", "seconds", "cpu_seconds", "fetches"):
        if not isinstance(report.get(name), int | float):
            raise GraphileError(f"graphile drain report: {name!r} missing or not a number "
                                f"in {report}")
    if report["performed"] != jobs:
        raise GraphileError(f"graphile drain: performed {report['performed']} jobs, "
                            f"expected {jobs}")
    if settings.local_queue > 0 and report["fetches"] == 0:
        raise GraphileError("graphile drain: local_queue was set but the local queue never "
                            "fetched: the settings did not reach the worker")


# -- installing the pinned package -------------------------------------------------------

def missing_tools() -> str | None:
    """Why the section cannot run here (node or npm not found), or None."""
    missing = [tool for tool in ("node", "npm") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found: {INSTALL_HINT}"
    return None


def cache_root() -> Path:
    """Where peers' packages are installed: outside the repository."""
    explicit = os.environ.get("OUTBOX_BENCH_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "outbox-benchmarks"


def _package_hash() -> str:
    digest = hashlib.sha256()
    for name in PACKAGE_FILES:
        digest.update((PEER / name).read_bytes())
    return digest.hexdigest()[:16]


def install(cache: Path | None = None) -> Path:
    """The ``node_modules`` directory holding the pinned Graphile Worker, installed with
    ``npm ci`` (the lock file's exact versions, no install scripts) on first use."""
    target = (cache or cache_root()) / f"graphile-worker-{VERSION}-{_package_hash()}"
    modules = target / "node_modules"
    if (modules / "graphile-worker" / "package.json").exists():
        return modules
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="graphile-", dir=target.parent))
    try:
        for name in PACKAGE_FILES:
            shutil.copy2(PEER / name, staging / name)
        log.warning("installing graphile-worker %s into %s (once)", VERSION, target)
        done = subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--ignore-scripts"],
                              cwd=staging, capture_output=True, text=True, timeout=600,
                              check=False)
        if done.returncode != 0:
            raise GraphileError(f"npm ci failed in {staging} (exit {done.returncode}):\n"
                                f"{done.stderr[-2000:]}")
        try:
            staging.rename(target)
        except OSError:
            # Another invocation installed it meanwhile; theirs is as good as ours.
            if not (modules / "graphile-worker" / "package.json").exists():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return modules


# -- one drain of Graphile Worker ------------------------------------------------------

def _environment(dsn: str, modules: Path) -> dict[str, str]:
    """The driver's environment: the database as PG* variables, the installed package
    on NODE_PATH."""
    parts = conninfo_to_dict(dsn)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    for key, var in (("host", "PGHOST"), ("port", "PGPORT"), ("user", "PGUSER"),
                     ("dbname", "PGDATABASE"), ("password", "PGPASSWORD")):
        if parts.get(key):
            env[var] = str(parts[key])
    env["NODE_PATH"] = str(modules)
    return env


def _read_line(proc: subprocess.Popen[bytes], deadline: float) -> bytes:
    """One line of the driver's stdout, waiting until ``deadline`` at most."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    chunks: list[bytes] = []
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise GraphileError("graphile driver: no report in time")
        ready, _, _ = select.select([fd], [], [], remaining)
        if not ready:
            continue
        byte = os.read(fd, 1)
        if not byte or byte == b"\n":
            return b"".join(chunks)
        chunks.append(byte)


def seed(dsn: str, jobs: int, modules: Path, timeout: float) -> float:
    """Graphile Worker's schema and ``jobs`` no-op jobs added with ``addJobs``; jobs/s."""
    done = subprocess.run(["node", str(DRIVER), "seed", str(jobs)], env=_environment(dsn, modules),
                          capture_output=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise GraphileError(f"graphile seed failed (exit {done.returncode}):\n"
                            f"{done.stderr.decode(errors='replace')[-2000:]}")
    report = parse_report(done.stdout.strip().splitlines()[-1] if done.stdout.strip() else b"",
                          "seeded")
    return jobs / float(report["seconds"])


def measure(srv: Server, config: GraphileConfig, jobs: int, modules: Path,
            settings: GraphileSettings | None = None) -> drain.DrainRun:
    """One drain of ``jobs`` by one Graphile Worker process in a fresh database."""
    settings = settings or config.graphile
    timeout = config.timeout(jobs)
    with fresh_database(srv, THEIRS) as dsn:
        enqueue_rate = seed(dsn, jobs, modules, timeout)
        settle(dsn)
        server_cpu = ServerCpu.of(dsn)
        proc = subprocess.Popen(
            ["node", str(DRIVER), "drain", str(jobs), settings.as_json()],
            env=_environment(dsn, modules), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE)
        try:
            assert proc.stdin is not None and proc.stderr is not None
            deadline = time.monotonic() + timeout
            parse_report(_read_line(proc, deadline), "ready")
            before = server_cpu.seconds() if server_cpu else 0.0
            started = time.perf_counter()
            proc.stdin.write(b"go\n")
            proc.stdin.flush()
            line = _read_line(proc, deadline)
            seconds = time.perf_counter() - started
            proc.stdin.close()
            proc.wait(max(1.0, deadline - time.monotonic()))
            stderr = proc.stderr.read().decode(errors="replace")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if proc.returncode != 0:
            raise GraphileError(f"graphile drain failed (exit {proc.returncode}):\n"
                                f"{stderr[-2000:]}")
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
    modules = install(config.cache)
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
    variants += [replace(base, local_queue=size) for size in (100, 500, 1000, 2000, 5000)]
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
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    why = missing_tools()
    if why is not None:
        print(f"skipped: {why}")
        return 0
    config = GraphileConfig(runs=args.runs, sizes=(args.jobs,))
    load_before = _load()
    with server(args.dsn) as srv:
        found = sweep(srv, config, grid())
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
    return 0


if __name__ == "__main__":
    raise SystemExit(_sweep_main())
