"""Section ``targets``: one process serving many schema targets, against a dispatcher
process per target.

A fresh database holds ``schemas`` migrated outbox schemas (t000, t001, ...; cloned
from a template database migrated once per section, so every run starts from the same
files) and one no-op job in each. The fleet is one process running
``Dispatcher(effects=[noop], targets=outbox.targets.schemas(dsn),
max_connections=16)``; the baseline is one process per schema running
``Dispatcher(dsn, [noop], schema=name)``, all released together. Both use the
dispatcher's defaults otherwise; the processes come from the forkserver that has
already imported outbox, prepared (dispatchers built, the fleet's schemas listed) before
the clock starts.

Figures, each run in a fresh database:

- before: the jobs are committed before the start and ``run_until_idle`` drains them.
  When the last job was done (the latest ledger ``recorded_at``, against the server's
  clock read just before the release), when the last process returned, the most client
  backends connected to the database while it ran (``pg_stat_activity`` sampled every
  ``sample_interval`` seconds from a connection to another database), and the peak RSS
  (VmHWM) of the fleet's process, or the sum of the processes' peaks.
- while running: the dispatchers run ``run()`` (the fleet with its look-out connection
  LISTENing for every schema); once the connections have been steady for
  ``steady_seconds`` (the fleet's first turns over), ``singles`` jobs are committed one
  at a time in a random schema, 0.1-0.3 s apart, each waited for: the wake-up of an
  idle dispatcher, commit-to-done (``recorded_at - created_at``, both the server's
  clock). Then one job per schema, one transaction each, in schema order: when the last
  was done after the first commit, each one's commit-to-done (median, worst), how long
  the commits took, and the most connections from the first commit to the last job done.

Runs alternate: fleet, processes, fleet while running, processes while running.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from multiprocessing.synchronize import Event as EventType
from typing import Any

import psycopg
from psycopg import sql

import outbox

from ._db import Server, migrated, settle
from ._effects import NOOP, Noop, payload
from ._procs import Prepared, WorkerFailed, context, run_released, services
from ._results import Row, Section, Target
from ._rss import peak_rss, pss, rss
from ._stats import Figure, percentile, ratios

log = logging.getLogger("benchmarks.targets")

MB = 1024 * 1024
PARENT = "bench-targets"  # the parent's own connections, not counted
FLEET = "fleet"
PROCESSES = "processes"
CONNECTIONS_PER_PROCESS = 3  # a dispatcher in run(): claimer, recorder, listener


def server_settings(schemas: int) -> dict[str, str]:
    """What the embedded server needs: a connection for each part of each process of
    the baseline (and room for everything else)."""
    return {"max_connections": str(max(100, (CONNECTIONS_PER_PROCESS + 1) * schemas + 100))}


@dataclass(frozen=True)
class TargetsConfig:
    runs: int
    schemas: int = 200
    max_connections: int = 16
    live: bool = True
    singles: int = 10  # live: jobs committed one at a time first, each waited for
    sample_interval: float = 0.01
    steady_seconds: float = 1.5
    timeout: float = 600.0

    @property
    def names(self) -> list[str]:
        width = max(3, len(str(self.schemas - 1)))
        return [f"t{n:0{width}d}" for n in range(self.schemas)]


# -- the workers (child processes) ----------------------------------------------------------

@dataclass(frozen=True)
class FleetSpec:
    dsn: str
    max_connections: int
    timeout: float
    stop: EventType | None = None  # None: run_until_idle; else run() until set


@dataclass(frozen=True)
class ProcessSpec:
    dsn: str
    schema: str
    timeout: float
    stop: EventType | None = None


def _serve(dispatcher: outbox.Dispatcher, stop: EventType | None,
           timeout: float) -> dict[str, Any]:
    began = time.perf_counter()
    if stop is None:
        stats = dispatcher.run_until_idle(timeout=timeout)
    else:
        def stop_when_told() -> None:
            stop.wait(timeout)
            dispatcher.stop()

        threading.Thread(target=stop_when_told, daemon=True).start()
        stats = dispatcher.run()
    return {"stats": stats.as_dict(), "seconds": time.perf_counter() - began,
            "peak_rss_bytes": peak_rss(), "final_rss_bytes": rss(), "pss_bytes": pss()}


def fleet_worker(spec: FleetSpec) -> Prepared:
    """One dispatcher serving every outbox schema of the database."""
    targets = outbox.targets.schemas(spec.dsn)
    dispatcher = outbox.Dispatcher(effects=[Noop()], targets=targets,
                                   max_connections=spec.max_connections)
    return Prepared(lambda: _serve(dispatcher, spec.stop, spec.timeout),
                    info={"rss": rss(), "targets": len(targets)})


def process_worker(spec: ProcessSpec) -> Prepared:
    """One dispatcher bound to one schema."""
    dispatcher = outbox.Dispatcher(spec.dsn, [Noop()], schema=spec.schema)
    return Prepared(lambda: _serve(dispatcher, spec.stop, spec.timeout),
                    info={"rss": rss()})


# -- the parent's side ------------------------------------------------------------------------

class _Connections:
    """The client backends connected to one database, sampled on a thread every
    ``interval`` seconds through a connection to another database (the server's own),
    so the sampler is never counted. Keeps each change as (seconds since start, count)."""

    _QUERY = ("SELECT count(*) FROM pg_stat_activity WHERE datname = %s "
              "AND backend_type = 'client backend' "
              "AND application_name IS DISTINCT FROM %s")

    def __init__(self, server_dsn: str, dbname: str, interval: float) -> None:
        self.dbname = dbname
        self.interval = interval
        self.conn = psycopg.connect(server_dsn, autocommit=True, application_name=PARENT)
        self.changes: list[tuple[float, int]] = []
        self.samples = 0
        self.started = time.perf_counter()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-connections",
                                        daemon=True)

    def now(self) -> datetime:
        """The server's clock (call before ``start``: the thread owns the connection)."""
        row = self.conn.execute("SELECT clock_timestamp()").fetchone()
        assert row is not None
        return row[0]  # type: ignore[no-any-return]

    def start(self) -> None:
        self.started = time.perf_counter()
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping.is_set():
            row = self.conn.execute(self._QUERY, (self.dbname, PARENT), prepare=True).fetchone()
            count = int(row[0]) if row else 0
            self.samples += 1
            if not self.changes or self.changes[-1][1] != count:
                self.changes.append((time.perf_counter() - self.started, count))
            self._stopping.wait(self.interval)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def current(self) -> int:
        return self.changes[-1][1] if self.changes else 0

    def steady_for(self) -> float:
        """Seconds since the count last changed."""
        return self.elapsed() - self.changes[-1][0] if self.changes else 0.0

    def most(self, since: float = 0.0, until: float = math.inf) -> int:
        """The most connections seen between ``since`` and ``until`` (seconds): the
        count standing at ``since`` and every change up to ``until``."""
        standing = [count for at, count in self.changes if at <= since][-1:]
        within = [count for at, count in self.changes if since < at <= until]
        return max(standing + within, default=0)

    def close(self) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join()
        self.conn.close()


@contextlib.contextmanager
def _template(server: Server, config: TargetsConfig) -> Iterator[str]:
    """A database with ``config.schemas`` migrated outbox schemas, settled; each run's
    database is a copy of it. Dropped afterwards."""
    name = f"bench_targets_template_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        dsn = server.database(name)
        began = time.perf_counter()
        for schema in config.names:
            migrated(dsn, schema)
        settle(dsn)
        log.info("targets: %d schemas migrated and settled in %.0f s", config.schemas,
                 time.perf_counter() - began)
        yield name
    finally:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)")
                         .format(sql.Identifier(name)))


@contextlib.contextmanager
def _copy(server: Server, template: str) -> Iterator[tuple[str, str]]:
    """A fresh copy of the template database: (its name, its DSN). FILE_COPY: a
    checkpoint and a copy of the files, quicker than WAL-logging thousands of small
    relations; the copy is checkpointed once made."""
    name = f"bench_targets_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {} STRATEGY FILE_COPY").format(
            sql.Identifier(name), sql.Identifier(template)))
    try:
        yield name, server.database(name)
    finally:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)")
                         .format(sql.Identifier(name)))


def _enqueue_each(dsn: str, names: Sequence[str], tag: str) -> float:
    """One job per schema, a transaction each, in order; seconds taken."""
    began = time.perf_counter()
    with psycopg.connect(dsn, application_name=PARENT) as conn:
        for n, schema in enumerate(names):
            with outbox.transaction(conn, schema=schema) as tx:
                tx.enqueue(NOOP, key=f"{tag}-{n}", payload=payload(n))
    return time.perf_counter() - began


def _each(names: Sequence[str], template: str) -> sql.Composed:
    """``template`` for every schema, UNION ALL: ``{schema}`` its identifier, ``{name}``
    its name as a literal."""
    return sql.SQL(" UNION ALL ").join(
        sql.SQL(template).format(schema=sql.Identifier(name), name=sql.Literal(name))
        for name in names)


def _outcome(dsn: str, names: Sequence[str], start: datetime,
             like: str = "%") -> dict[str, Any]:
    """From the ledgers and jobs of every schema (the jobs whose key is ``like``): when
    the last job was done after ``start``, each job's commit-to-done, how many are done
    and recorded."""
    query = sql.SQL(
        "SELECT extract(epoch FROM r.recorded_at - %(start)s)::float8, "
        "extract(epoch FROM r.recorded_at - j.created_at)::float8, j.status "
        "FROM ({jobs}) j LEFT JOIN ({ledger}) r ON r.schema = j.schema AND r.key = j.key "
        "WHERE j.key LIKE %(like)s"
    ).format(jobs=_each(names, "SELECT {name}::text AS schema, key, status, created_at "
                        "FROM {schema}.jobs"),
             ledger=_each(names, "SELECT {name}::text AS schema, key, recorded_at "
                          "FROM {schema}.effect_results"))
    with psycopg.connect(dsn, autocommit=True, application_name=PARENT) as conn:
        rows = conn.execute(query, {"start": start, "like": like}).fetchall()
    done = [r for r in rows if r[0] is not None and r[2] == "done"]
    after = [float(r[0]) for r in done]
    latency = [float(r[1]) for r in done]
    return {"jobs": len(rows), "done": len(done),
            "last_done": max(after) if after else math.nan,
            "first_done": min(after) if after else math.nan,
            "commit_to_done_p50": percentile(latency, 0.5),
            "commit_to_done_max": max(latency) if latency else math.nan}


def _ledger_count(conn: psycopg.Connection[Any], names: Sequence[str]) -> int:
    query = sql.SQL("SELECT count(*) FROM ({}) r").format(
        _each(names, "SELECT key FROM {schema}.effect_results"))
    row = conn.execute(query).fetchone()
    return int(row[0]) if row else 0


def _checked(kind: str, outcome: dict[str, Any], expected: int) -> None:
    if (outcome["jobs"], outcome["done"]) != (expected, expected):
        raise AssertionError(f"targets {kind}: {outcome['done']} of {outcome['jobs']} jobs "
                             f"done and recorded, {expected} expected")


def _rss_total(results: Sequence[dict[str, Any]]) -> int:
    return sum(int(r["peak_rss_bytes"]) for r in results)


def measure_before(server: Server, template: str, config: TargetsConfig,
                   kind: str) -> dict[str, Any]:
    """The jobs committed first, then ``run_until_idle`` by the fleet or the processes."""
    names = config.names
    with _copy(server, template) as (dbname, dsn):
        _enqueue_each(dsn, names, "before")
        with psycopg.connect(dsn, autocommit=True, application_name=PARENT) as conn:
            conn.execute("CHECKPOINT")
        sampler = _Connections(server.dsn, dbname, config.sample_interval)
        starts: list[datetime] = []

        def release(pids: list[int]) -> None:
            starts.append(sampler.now())
            sampler.start()

        try:
            if kind == FLEET:
                released = run_released(
                    fleet_worker, [FleetSpec(dsn, config.max_connections, config.timeout)],
                    timeout=config.timeout + 60, before_release=release)
            else:
                released = run_released(
                    process_worker, [ProcessSpec(dsn, s, config.timeout) for s in names],
                    timeout=config.timeout + 60, before_release=release)
        finally:
            sampler.close()
        outcome = _outcome(dsn, names, starts[0])
    _checked(f"{kind} before", outcome, config.schemas)
    result = {
        "kind": kind, "returned": released.seconds, **outcome,
        "most_connections": sampler.most(), "connection_samples": sampler.samples,
        "connections": sampler.changes,
        "peak_rss_total": _rss_total(released.results),
        "peak_rss_max": max(int(r["peak_rss_bytes"]) for r in released.results),
        "pss_total": sum(int(r["pss_bytes"]) for r in released.results),
        "idle_rss_total": sum(int(i["rss"]) for i in released.infos),
        "done_by_dispatchers": sum(int(r["stats"]["done"]) for r in released.results),
    }
    log.info("targets %s, jobs before: last done at %.2f s, returned at %.2f s, "
             "%d connections at most, %.0f MB", kind, result["last_done"],
             result["returned"], result["most_connections"],
             result["peak_rss_total"] / MB)
    return result


def _wait_steady(sampler: _Connections, config: TargetsConfig, kind: str) -> None:
    """Until the connections have not changed for ``steady_seconds`` (the fleet's first
    turns, or the processes' start, are over)."""
    deadline = time.monotonic() + config.timeout
    while sampler.steady_for() < config.steady_seconds or sampler.elapsed() < 2:
        if time.monotonic() > deadline:
            raise AssertionError(f"targets {kind} live: connections never steady")
        time.sleep(0.05)


def _single(conn: psycopg.Connection[Any], schema: str, key: str, n: int,
            deadline: float) -> float:
    """Commit one job to ``schema`` and wait until it is recorded: its commit-to-done
    (the ledger's ``recorded_at`` minus the job's ``created_at``), in seconds."""
    with outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue(NOOP, key=key, payload=payload(n))
    query = sql.SQL(
        "SELECT extract(epoch FROM r.recorded_at - j.created_at)::float8 "
        "FROM {schema}.effect_results r JOIN {schema}.jobs j ON j.key = r.key "
        "WHERE r.key = %s").format(schema=sql.Identifier(schema))
    while time.monotonic() < deadline:
        row = conn.execute(query, (key,)).fetchone()
        if row is not None:
            return float(row[0])
        time.sleep(0.005)
    raise AssertionError(f"targets live: job {key} in {schema} not done in time")


def measure_live(server: Server, template: str, config: TargetsConfig,
                 kind: str) -> dict[str, Any]:
    """The dispatchers in ``run()``; once steady, ``singles`` jobs one at a time (each
    waited for), then a commit per schema."""
    names = config.names
    stop = context().Event()
    rng = random.Random(7)
    with _copy(server, template) as (dbname, dsn):
        setup: Any
        if kind == FLEET:
            setup = fleet_worker
            args: list[Any] = [FleetSpec(dsn, config.max_connections, config.timeout, stop)]
        else:
            setup = process_worker
            args = [ProcessSpec(dsn, s, config.timeout, stop) for s in names]
        sampler = _Connections(server.dsn, dbname, config.sample_interval)
        try:
            with services(setup, args, stop_event=stop, timeout=config.timeout + 60,
                          before_release=lambda pids: sampler.start()) as running:
                _wait_steady(sampler, config, kind)
                steady, steady_most = sampler.current(), sampler.most()
                deadline = time.monotonic() + config.timeout
                with psycopg.connect(dsn, autocommit=True, application_name=PARENT) as conn:
                    singles = []
                    for i in range(config.singles):
                        time.sleep(rng.uniform(0.1, 0.3))
                        singles.append(_single(conn, rng.choice(names), f"single-{i}", i,
                                               deadline))
                    row = conn.execute("SELECT clock_timestamp()").fetchone()
                    assert row is not None
                    start, began = row[0], sampler.elapsed()
                    spent = _enqueue_each(dsn, names, "live")
                    while _ledger_count(conn, names) < config.schemas + config.singles:
                        if time.monotonic() > deadline:
                            raise AssertionError(f"targets {kind} live: jobs not done in "
                                                 "time")
                        time.sleep(0.05)
                    ended = sampler.elapsed()
        finally:
            sampler.close()
        outcome = _outcome(dsn, names, start, like="live-%")
    _checked(f"{kind} live", outcome, config.schemas)
    results = running.results
    result = {
        "kind": kind, **outcome, "enqueue_seconds": spent, "singles": singles,
        "single_p50": percentile(singles, 0.5),
        "single_max": max(singles) if singles else math.nan,
        "steady_connections": steady, "most_connections_before": steady_most,
        "most_connections": sampler.most(began, ended),
        "connection_samples": sampler.samples, "connections": sampler.changes,
        "peak_rss_total": _rss_total(results),
        "pss_total": sum(int(r["pss_bytes"]) for r in results),
        "done_by_dispatchers": sum(int(r["stats"]["done"]) for r in results),
    }
    log.info("targets %s, jobs while running: one job at a time done in %.3f s (median, "
             "worst %.3f s); a commit per schema: last done at %.2f s after the first "
             "commit (commits took %.2f s), commit-to-done %.2f s median, %.2f s worst, %d "
             "connections at most (%d steady)", kind, result["single_p50"],
             result["single_max"], result["last_done"], spent,
             result["commit_to_done_p50"], result["commit_to_done_max"],
             result["most_connections"], steady)
    return result


def _attempt(measure: Any, *args: Any) -> dict[str, Any]:
    """A measurement, or what refused it (too many connections for the server, say)."""
    try:
        return measure(*args)  # type: ignore[no-any-return]
    except (WorkerFailed, psycopg.OperationalError) as exc:
        log.warning("targets: %s failed: %s", args[-1], exc)
        return {"kind": args[-1], "error": str(exc)[-2000:]}


def _server_max_connections(server: Server) -> int:
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        row = conn.execute("SHOW max_connections").fetchone()
    return int(row[0]) if row else 0


def run(server: Server, config: TargetsConfig) -> Section:
    """Fleet and processes, jobs before and while running, ``config.runs`` times each,
    alternating."""
    cases = [("before", measure_before)] + ([("live", measure_live)] if config.live else [])
    results: dict[str, dict[str, list[dict[str, Any]]]] = {
        case: {FLEET: [], PROCESSES: []} for case, _ in cases}
    with _template(server, config) as template:
        for _ in range(config.runs):
            for case, measure in cases:
                for kind in (FLEET, PROCESSES):
                    results[case][kind].append(_attempt(measure, server, template, config,
                                                        kind))
    return _section(server, config, results)


def _values(found: list[dict[str, Any]], key: str, scale: float = 1.0) -> list[float]:
    return [float(r[key]) / scale if key in r else math.nan for r in found]


def _section(server: Server, config: TargetsConfig,
             results: dict[str, dict[str, list[dict[str, Any]]]]) -> Section:
    n, budget = config.schemas, config.max_connections
    refused = {f"{case} {kind}": [r["error"] for r in found if "error" in r]
               for case, kinds in results.items() for kind, found in kinds.items()}
    refused = {k: v for k, v in refused.items() if v}

    def row(case: str, name: str, unit: str, key: str, target: Target | None = None,
            scale: float = 1.0) -> Row:
        mine = _values(results[case][FLEET], key, scale)
        base = _values(results[case][PROCESSES], key, scale)
        note = "; ".join(f"{k} failed {len(v)}x" for k, v in refused.items()
                         if k.startswith(case))
        return Row("targets", name, unit, Figure.of(mine), f"{n} processes",
                   Figure.of(base), ratios(mine, base), target, note=note)

    what = f"{n} schemas, a job each"
    rows = [
        row("before", f"{what}, committed before the start: the last job done after the "
            "start", "s", "last_done"),
        row("before", f"{what}, committed before: run_until_idle returned (fleet), the "
            "last process returned", "s", "returned"),
        row("before", f"{what}, committed before: most connections to the database",
            "conns", "most_connections", Target("<=", budget, on="value")),
        row("before", f"{what}, committed before: peak RSS (fleet: its process; "
            "processes: the sum of their peaks)", "MB", "peak_rss_total", scale=MB),
        row("before", f"{what}, committed before: PSS at the end (the forked processes' "
            "shared pages divided among them), summed", "MB", "pss_total", scale=MB),
    ]
    if "live" in results:
        rows += [
            row("live", f"while running: one job at a time (in a random schema, "
                f"{config.singles} per run, each waited for), commit-to-done, median", "s",
                "single_p50"),
            row("live", "while running: one job at a time, commit-to-done, worst", "s",
                "single_max"),
            row("live", f"{what}, a commit per schema while running: the last job done "
                "after the first commit", "s", "last_done"),
            row("live", f"{what}, a commit per schema while running: commit-to-done of "
                "a job, median", "s", "commit_to_done_p50"),
            row("live", f"{what}, a commit per schema while running: commit-to-done of "
                "a job, worst", "s", "commit_to_done_max"),
            row("live", f"{what}, while running: the {n} commits took (one connection, "
                "in turn)", "s", "enqueue_seconds"),
            row("live", f"{n} schemas, while running: connections when idle (steady)",
                "conns", "steady_connections", Target("<=", budget, on="value")),
            row("live", f"{what}, while running: most connections from the first commit "
                "to the last job done", "conns", "most_connections",
                Target("<=", budget, on="value")),
            row("live", f"{n} schemas, while running: peak RSS (fleet: its process; "
                "processes: the sum)", "MB", "peak_rss_total", scale=MB),
        ]
    settings = {
        "fleet": f"one process, Dispatcher(effects=[noop], targets=outbox.targets."
                 f"schemas(dsn), max_connections={budget}), defaults otherwise",
        "processes": f"{n} processes, Dispatcher(dsn, [noop], schema=tNNN), defaults, "
                     "released together",
        "database": f"{n} migrated schemas in a fresh copy of a settled template "
                    "database per run; one no-op job per schema",
        "connections": f"client backends of the database in pg_stat_activity, sampled "
                       f"every {config.sample_interval * 1000:.0f} ms",
        "memory": "peak RSS is each process's VmHWM; the processes are forked from a "
                  "forkserver, so they share its pages and the machine held less than "
                  "their sum (about the sum of their PSS), but separate interpreters "
                  "would each hold about their RSS",
        "server max_connections": str(_server_max_connections(server)),
        "targets": f"fleet's connections <= {budget} (its max_connections)",
    }
    if refused:
        settings["failed"] = "; ".join(f"{k}: {v[0].splitlines()[-1]}"
                                       for k, v in refused.items())
    raw = {"config": asdict(config), "runs": results}
    return Section("targets", rows, raw=raw, settings=settings)
