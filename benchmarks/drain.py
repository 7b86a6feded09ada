"""Section 1, drain: no-op jobs per second, our dispatcher against the limit probe and
the peer queues, each system in a fresh database, jobs enqueued before the clock.

The clock starts when the worker processes (started, connected, prepared) are released
and stops when the last of them returns; afterwards the database is checked to hold
exactly what a complete drain leaves behind.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import asyncpg
from pgqueuer import AsyncpgDriver, Queries

from . import _drain_workers as workers
from ._cpu import ServerCpu, wait_for_clients_to_leave
from ._db import Server, asyncpg_params, fresh_database, migrated, scalar, settle
from ._procs import Setup, run_released
from ._results import Row, Section
from ._seed import CHUNK, enqueue_outbox, seed_pending
from ._stats import Figure, ratios

log = logging.getLogger("benchmarks.drain")

# "outbox" runs with the settings given (cli.BEST_OUTBOX: done jobs deleted at once);
# "outbox-retained" with the same settings but the default retention, done rows kept;
# "outbox-sql" the dispatcher's claim and complete_delete statements alone, on two
# connections at once: the ceiling of the SQL, which no dispatcher on it can pass;
# "floor" the leanest statements that still write a lease, a fencing token and a ledger
# row per job (_drain_workers.FLOOR_TABLES), on as many connections: a ceiling for designs
# that keep the guarantees; "floor-indexed" the same with its lease indexed, so
# that no claim is HOT, as none of ours is; "floor-busy" the floor with FLOOR_HELD older
# jobs claimed and held throughout (a HOT claim leaves claimed rows in the claim index, so
# each claim walks past the jobs in flight: the price of a HOT claim in a busy fleet).
# "outbox-gc-frozen" is "outbox" in a process that froze what it held before the release
# (gc.freeze()): what the cyclic collector's full passes over a process's modules cost
# the drain.
SYSTEMS = ("outbox", "outbox-retained", "outbox-gc-frozen", "outbox-sql", "floor",
           "floor-indexed", "floor-busy", "probe", "pgqueuer", "procrastinate")
FLOOR_HELD = 10_000
# The rows comparing two systems run in the same invocation: (system, baseline, what the
# baseline is), each row shown when both ran.
COMPARISONS = (
    ("outbox", "outbox-retained", "outbox-retained"),
    ("outbox-gc-frozen", "outbox", "outbox"),
    ("outbox-gc-frozen", "floor", "the design floor"),
    ("outbox", "outbox-sql", "its SQL alone"),
    ("outbox-sql", "floor", "the design floor"),
    ("outbox", "floor", "the design floor"),
    ("floor-indexed", "floor", "the design floor"),
    ("floor-busy", "floor", "the design floor"),
    ("outbox", "pgqueuer", "pgqueuer"),
)


@dataclass(frozen=True)
class DrainConfig:
    sizes: tuple[int, ...]
    procs: tuple[int, ...]
    runs: int
    systems: tuple[str, ...] = SYSTEMS
    outbox: workers.OutboxSettings = field(default_factory=workers.OutboxSettings)
    probe_batch: int = 100
    sql_ceiling_connections: int = 2
    pgqueuer_batch: int = 500
    pgqueuer_max_tasks: int | None = None
    procrastinate_concurrency: int = 10
    # procrastinate drains about 1% as fast as the others: by default it runs at this one
    # size only (None: at every size).
    procrastinate_jobs: int | None = 20_000

    def sizes_for(self, system: str) -> tuple[int, ...]:
        if system == "procrastinate" and self.procrastinate_jobs is not None:
            return (self.procrastinate_jobs,)
        return self.sizes

    def all_sizes(self) -> list[int]:
        return sorted({size for system in self.systems for size in self.sizes_for(system)})

    def timeout(self, jobs: int) -> float:
        return 60.0 + jobs / 100


@dataclass
class DrainRun:
    system: str
    jobs: int
    procs: int
    seconds: float
    jobs_per_second: float
    enqueue_per_second: float
    workers: list[Any]
    # CPU seconds: the worker processes' together, from release to their return, and
    # the server's, from release until their backends have left (None when its
    # processes cannot be read from here).
    client_cpu_seconds: float = 0.0
    server_cpu_seconds: float | None = None

    def cpu_per_job(self) -> tuple[float, float] | None:
        """Microseconds of CPU per job: (server, client), when the server's is known."""
        if self.server_cpu_seconds is None:
            return None
        return (self.server_cpu_seconds / self.jobs * 1e6,
                self.client_cpu_seconds / self.jobs * 1e6)


# -- per-system preparation and checks ---------------------------------------------------

def _prepare_outbox(dsn: str, jobs: int) -> float:
    migrated(dsn)
    return enqueue_outbox(dsn, jobs)


def _prepare_floor(dsn: str, jobs: int, *, lease_index: bool = False, held: int = 0) -> float:
    """Our jobs enqueued (``held`` more, claimed and held before the clock), copied into
    the floor's table (``workers.floor_tables``)."""
    rate = _prepare_outbox(dsn, jobs + held)
    workers.floor_tables(dsn, lease_index=lease_index, held=held)
    return rate


def _prepare_probe(dsn: str, jobs: int) -> float:
    migrated(dsn)
    return seed_pending(dsn, jobs, prefix="probe-")


async def _pgqueuer_enqueue(dsn: str, jobs: int) -> float:
    conn = await asyncpg.connect(**asyncpg_params(dsn))
    try:
        queries = Queries(AsyncpgDriver(conn))
        await queries.install()
        started = time.perf_counter()
        for first in range(0, jobs, CHUNK):
            count = min(CHUNK, jobs - first)
            await queries.enqueue([workers.PGQUEUER_ENTRYPOINT] * count,
                                  [b'{"n":%d}' % (first + i) for i in range(count)],
                                  [0] * count)
        return jobs / (time.perf_counter() - started)
    finally:
        await conn.close()


def _prepare_pgqueuer(dsn: str, jobs: int) -> float:
    return asyncio.run(_pgqueuer_enqueue(dsn, jobs))


async def _procrastinate_enqueue(dsn: str, jobs: int) -> float:
    app = workers.procrastinate_app(dsn)
    async with app.open_async():
        await app.schema_manager.apply_schema_async()
        task = app.tasks[workers.PROCRASTINATE_TASK]
        started = time.perf_counter()
        for first in range(0, jobs, CHUNK):
            batch: list[dict[str, Any]] = [{"n": i} for i in range(first, min(jobs, first + CHUNK))]
            await task.batch_defer_async(*batch)
        return jobs / (time.perf_counter() - started)


def _prepare_procrastinate(dsn: str, jobs: int) -> float:
    return asyncio.run(_procrastinate_enqueue(dsn, jobs))


def _check(what: str, found: Any, expected: int) -> None:
    if found != expected:
        raise AssertionError(f"{what}: found {found}, expected {expected}")


def _verify_outbox(dsn: str, jobs: int) -> None:
    # Every job done: its row marked done, or deleted (retention 0); its ledger row kept.
    _check("outbox jobs not done", scalar(
        dsn, "SELECT count(*) FROM outbox.jobs WHERE status <> 'done'"), 0)
    _check("outbox ledger rows", scalar(dsn, "SELECT count(*) FROM outbox.effect_results"), jobs)


def _verify_floor(dsn: str, jobs: int, *, held: int = 0) -> None:
    _check("floor jobs left", scalar(dsn, "SELECT count(*) FROM outbox.floor_jobs"), held)
    _check("floor jobs left unclaimed", scalar(
        dsn, "SELECT count(*) FROM outbox.floor_jobs WHERE claimed_by IS DISTINCT FROM 'held'"), 0)
    _check("floor ledger rows", scalar(dsn, "SELECT count(*) FROM outbox.floor_ledger"), jobs)


def _verify_probe(dsn: str, jobs: int) -> None:
    _check("probe rows left", scalar(dsn, "SELECT count(*) FROM outbox.jobs"), 0)


def _verify_pgqueuer(dsn: str, jobs: int) -> None:
    _check("pgqueuer rows left", scalar(dsn, "SELECT count(*) FROM pgqueuer"), 0)


def _verify_procrastinate(dsn: str, jobs: int) -> None:
    _check("procrastinate jobs succeeded", scalar(
        dsn, "SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'"), jobs)


@dataclass(frozen=True)
class _System:
    prepare: Callable[[str, int], float]
    setup: Setup
    spec: Callable[[DrainConfig, str, float], Any]
    verify: Callable[[str, int], None]


def _statements_spec(config: DrainConfig, dsn: str, timeout: float) -> workers.StatementsSpec:
    return workers.StatementsSpec(dsn, config.outbox, config.sql_ceiling_connections, timeout)


_REGISTRY: dict[str, _System] = {
    "outbox": _System(
        _prepare_outbox, workers.outbox_worker,
        lambda c, dsn, t: workers.OutboxSpec(dsn, c.outbox, t),
        _verify_outbox),
    "outbox-retained": _System(
        _prepare_outbox, workers.outbox_worker,
        lambda c, dsn, t: workers.OutboxSpec(dsn, c.outbox.retained(), t),
        _verify_outbox),
    "outbox-gc-frozen": _System(
        _prepare_outbox, workers.outbox_worker,
        lambda c, dsn, t: workers.OutboxSpec(dsn, c.outbox, t, gc_frozen=True),
        _verify_outbox),
    "outbox-sql": _System(_prepare_outbox, workers.sql_ceiling_worker, _statements_spec,
                          _verify_outbox),
    "floor": _System(_prepare_floor, workers.floor_worker, _statements_spec, _verify_floor),
    "floor-busy": _System(
        partial(_prepare_floor, held=FLOOR_HELD), workers.floor_worker, _statements_spec,
        partial(_verify_floor, held=FLOOR_HELD)),
    "floor-indexed": _System(
        partial(_prepare_floor, lease_index=True), workers.floor_worker, _statements_spec,
        _verify_floor),
    "probe": _System(
        _prepare_probe, workers.probe_worker,
        lambda c, dsn, t: workers.ProbeSpec(dsn, c.probe_batch, t), _verify_probe),
    "pgqueuer": _System(
        _prepare_pgqueuer, workers.pgqueuer_worker,
        lambda c, dsn, t: workers.PgqueuerSpec(dsn, c.pgqueuer_batch, c.pgqueuer_max_tasks, t),
        _verify_pgqueuer),
    "procrastinate": _System(
        _prepare_procrastinate, workers.procrastinate_worker,
        lambda c, dsn, t: workers.ProcrastinateSpec(dsn, c.procrastinate_concurrency, t),
        _verify_procrastinate),
}


def measure(server: Server, config: DrainConfig, system: str, jobs: int, procs: int) -> DrainRun:
    """One drain of ``jobs`` by ``procs`` processes of ``system`` in a fresh database."""
    entry = _REGISTRY[system]
    with fresh_database(server, system) as dsn:
        enqueue_rate = entry.prepare(dsn, jobs)
        settle(dsn)
        timeout = config.timeout(jobs)
        server_cpu = ServerCpu.of(dsn)
        marks: list[float] = []
        released = run_released(
            entry.setup, [entry.spec(config, dsn, timeout)] * procs, timeout=timeout + 30,
            before_release=lambda _: marks.append(server_cpu.seconds() if server_cpu else 0.0))
        server_seconds = None
        if server_cpu is not None:
            wait_for_clients_to_leave(dsn)
            server_seconds = server_cpu.seconds() - marks[0]
        entry.verify(dsn, jobs)
    rate = jobs / released.seconds
    drained = DrainRun(system, jobs, procs, released.seconds, rate, enqueue_rate,
                       released.results, sum(released.cpu_seconds), server_seconds)
    cpu = drained.cpu_per_job()
    log.info("drain %s %d jobs x%d: %.0f jobs/s%s", system, jobs, procs, rate,
             f", CPU {cpu[0]:.1f} us/job server + {cpu[1]:.1f} client" if cpu else "")
    return drained


# -- the section ---------------------------------------------------------------------------

def _label(jobs: int) -> str:
    return f"{jobs // 1000}k" if jobs % 1000 == 0 else str(jobs)


def _runs_of(runs: list[DrainRun], system: str, jobs: int, procs: int) -> list[DrainRun]:
    """The runs of ``system`` at this size and process count, in the order they ran."""
    return [r for r in runs if r.system == system and r.jobs == jobs and r.procs == procs]


def _rates(runs: list[DrainRun], system: str, jobs: int, procs: int) -> list[float]:
    return [r.jobs_per_second for r in _runs_of(runs, system, jobs, procs)]


def _cpu(runs: list[DrainRun], system: str, jobs: int, procs: int) -> list[tuple[float, float]]:
    """Each run's (server, client) CPU microseconds per job; empty unless all are known."""
    found = [r.cpu_per_job() for r in _runs_of(runs, system, jobs, procs)]
    known = [c for c in found if c is not None]
    return known if len(known) == len(found) else []


def _cpu_rows(config: DrainConfig, runs: list[DrainRun], size: int, procs: int) -> list[Row]:
    """CPU per job, server and clients together, beside the probe's: the ratio (the probe's
    over the system's) is the share of the probe's rate the system can reach wherever
    CPU is what runs out."""
    rows: list[Row] = []
    probe = [server + client for server, client in _cpu(runs, "probe", size, procs)]
    for system in config.systems:
        mine = _cpu(runs, system, size, procs)
        if not mine:
            continue
        totals = [server + client for server, client in mine]
        split = (f"server {Figure.of([s for s, _ in mine]).median:.1f}"
                 f" + client {Figure.of([c for _, c in mine]).median:.1f}")
        name = f"{system} CPU {_label(size)} x{procs}"
        if system == "probe" or not probe:
            rows.append(Row("drain", name, "us/job", Figure.of(totals), note=split))
        else:
            rows.append(Row("drain", name, "us/job", Figure.of(totals),
                            "limit probe (its CPU / this)", Figure.of(probe),
                            ratios(probe, totals), note=split))
    return rows


def _size_rows(config: DrainConfig, runs: list[DrainRun], size: int, procs: int) -> list[Row]:
    rows: list[Row] = []
    probe = _rates(runs, "probe", size, procs)
    for system in config.systems:
        name = f"{system} {_label(size)} x{procs}"
        mine = _rates(runs, system, size, procs)
        if not mine:
            if size in config.sizes:
                rows.append(Row("drain", name, "jobs/s", Figure.of([]),
                                note="skipped: slow; --slow-peers runs it"))
            continue
        if system == "probe" or not probe:
            rows.append(Row("drain", name, "jobs/s", Figure.of(mine)))
        else:
            rows.append(Row("drain", name, "jobs/s", Figure.of(mine), "limit probe",
                            Figure.of(probe), ratios(mine, probe)))
    for system, baseline, described in COMPARISONS:
        mine, theirs = _rates(runs, system, size, procs), _rates(runs, baseline, size, procs)
        if mine and theirs:
            rows.append(Row("drain", f"{system} vs {baseline} {_label(size)} x{procs}",
                            "jobs/s", Figure.of(mine), described, Figure.of(theirs),
                            ratios(mine, theirs)))
    return rows


def _rows(config: DrainConfig, runs: list[DrainRun]) -> list[Row]:
    return [row for size in config.all_sizes() for procs in config.procs
            for row in _size_rows(config, runs, size, procs) + _cpu_rows(config, runs, size, procs)]


def run(server: Server, config: DrainConfig) -> Section:
    """Every system at its sizes and process counts, ``config.runs`` times, interleaved."""
    results: list[DrainRun] = []
    for _ in range(config.runs):
        for size in config.all_sizes():
            for procs in config.procs:
                for system in config.systems:
                    if size in config.sizes_for(system):
                        results.append(measure(server, config, system, size, procs))
    settings = {"outbox": config.outbox.describe(),
                "outbox-retained": config.outbox.retained().describe(),
                "outbox-gc-frozen": "outbox, gc.freeze() in each worker process before the "
                "release",
                "outbox-sql": "claim + complete_delete, the batch_size of outbox, "
                f"{config.sql_ceiling_connections} connections, no dispatcher",
                "floor": "HOT claim (lease + fencing token) + fenced delete + key-only "
                "ledger row on a lean table, the batch_size of outbox, "
                f"{config.sql_ceiling_connections} connections, no dispatcher",
                "floor-indexed": "floor with its lease indexed: no claim HOT",
                "floor-busy": f"floor with {FLOOR_HELD} older jobs claimed and held",
                "probe": f"batch {config.probe_batch}",
                "pgqueuer": f"asyncpg batch_size={config.pgqueuer_batch} "
                f"max_concurrent_tasks={config.pgqueuer_max_tasks}",
                "procrastinate": f"concurrency={config.procrastinate_concurrency}"}
    return Section("drain", _rows(config, results),
                   raw={"config": asdict(config), "runs": [asdict(r) for r in results]},
                   settings=settings)
