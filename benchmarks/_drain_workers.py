"""What runs inside each drain worker process, one setup function per system.

Each setup connects and builds everything before it returns; what it returns is what
the clock times. Every loop is bounded by a deadline.
"""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import asyncpg
import procrastinate
import psycopg
from pgqueuer import AsyncpgDriver, Queries, QueueManager
from pgqueuer.models import Job as PgqJob
from pgqueuer.types import QueueExecutionMode
from psycopg import sql
from psycopg.rows import namedtuple_row

import outbox
from outbox.sql import Queries as OutboxQueries

from ._db import asyncpg_params, table
from ._effects import AsyncNoop, Noop
from ._procs import Prepared
from ._rss import peak_rss, rss

# The limit probe: the least work a SKIP LOCKED queue can do per job (one statement
# per batch, no state kept, nothing recorded).
PROBE = """
DELETE FROM {jobs} WHERE id IN (
    SELECT id FROM {jobs} ORDER BY id LIMIT %(limit)s FOR UPDATE SKIP LOCKED
) RETURNING id
"""

# The design floor: the leanest statements we could write that still write what
# DESIGN.md requires of every job (a claim persisting its lease and fencing token, a
# fenced completion writing a ledger row), on a table built for nothing else. The jobs'
# own ids, keys and payloads are copied into it; its claim changes no indexed column, so
# each claim is a HOT update that adds no index entry, and its ledger holds the key
# alone. No feature of ours (fairness, ordering, retries, results, timestamps) is in it,
# nor any index to find expired leases by, which a real design needs: it is a ceiling to
# measure against, not a design.
FLOOR_TABLES = """
CREATE TABLE {floor} (
    id bigint PRIMARY KEY, key text NOT NULL UNIQUE, payload jsonb NOT NULL,
    available_at timestamptz NOT NULL, claim_version bigint NOT NULL DEFAULT 0,
    lease_until timestamptz, claimed_by text
) WITH (fillfactor = 50);
CREATE INDEX ON {floor} (available_at, id);
INSERT INTO {floor} (id, key, payload, available_at)
    SELECT id, key, payload, available_at FROM {jobs};
CREATE TABLE {floor_ledger} (key text PRIMARY KEY, job_id bigint NOT NULL,
                             claim_version bigint NOT NULL)
"""
FLOOR_CLAIM = """
UPDATE {floor} SET claim_version = claim_version + 1, claimed_by = %(worker)s,
    lease_until = now() + make_interval(secs => %(lease)s)
WHERE id IN (SELECT id FROM {floor} WHERE lease_until IS NULL ORDER BY available_at, id
             LIMIT %(limit)s FOR UPDATE SKIP LOCKED)
RETURNING id, key, claim_version, payload
"""
FLOOR_COMPLETE = """
WITH done AS (
    DELETE FROM {floor} AS f
    USING unnest(%(ids)s::bigint[], %(versions)s::bigint[]) AS c (id, version)
    WHERE f.id = c.id AND f.claim_version = c.version
    RETURNING f.id, f.key, f.claim_version)
INSERT INTO {floor_ledger} (key, job_id, claim_version)
SELECT key, id, claim_version FROM done
"""
# The floor with an index on its lease: each claim then changes an indexed column, so it
# is no longer HOT and adds an entry to the primary key, the key index and this one, as
# our claim does. What the floor loses to that alone.
FLOOR_LEASE_INDEX = "CREATE INDEX ON {floor} (lease_until) WHERE lease_until IS NOT NULL"
FLOOR_TABLE = ("outbox", "floor_jobs")
FLOOR_LEDGER = ("outbox", "floor_ledger")

PGQUEUER_ENTRYPOINT = "noop"
PROCRASTINATE_TASK = "noop"


@dataclass(frozen=True)
class OutboxSettings:
    """Our dispatcher's settings in a benchmark: the ``Dispatcher`` keyword arguments
    ``concurrency`` and ``batch_size``, any other keyword arguments in ``options``, and
    whether the no-op effect is ``async def``."""

    concurrency: int = 64
    batch_size: int | None = None
    async_effect: bool = False
    options: dict[str, Any] = field(default_factory=dict)

    def retained(self) -> OutboxSettings:
        """The same settings with the default retention (done rows kept), whatever
        ``options`` says: the figure for deployments that keep done jobs."""
        return replace(self, options={k: v for k, v in self.options.items()
                                      if k != "retention"})

    def describe(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in sorted(self.options.items()))
        return (f"concurrency={self.concurrency} batch_size={self.batch_size or 'default'}"
                f"{extra} effect={'async' if self.async_effect else 'sync'} no-op")


@dataclass(frozen=True)
class OutboxSpec:
    """Our dispatcher in a worker process; with ``gc_frozen``, every object the process
    holds before the release is moved out of the cyclic collector's reach
    (``gc.freeze()``), as a process that only dispatches may do once it has started."""

    dsn: str
    settings: OutboxSettings
    timeout: float
    gc_frozen: bool = False


@dataclass(frozen=True)
class StatementsSpec:
    """A loop of claim and completion statements with no dispatcher (``outbox-sql`` and
    the floors): on ``connections`` connections at once, claiming as many jobs at a time
    as a dispatcher with ``settings`` would."""

    dsn: str
    settings: OutboxSettings
    connections: int
    timeout: float


@dataclass(frozen=True)
class ProbeSpec:
    dsn: str
    batch: int
    timeout: float


@dataclass(frozen=True)
class PgqueuerSpec:
    dsn: str
    batch_size: int
    max_concurrent_tasks: int | None
    timeout: float


@dataclass(frozen=True)
class ProcrastinateSpec:
    dsn: str
    concurrency: int
    timeout: float


def outbox_worker(spec: OutboxSpec) -> Prepared:
    """Our real dispatcher: ``run_until_idle`` with full semantics. Its result holds the
    dispatcher's counters and the process's peak RSS."""
    dispatcher = _dispatcher(spec.dsn, spec.settings)
    if spec.gc_frozen:
        gc.freeze()

    def run() -> dict[str, Any]:
        stats = dispatcher.run_until_idle(timeout=spec.timeout).as_dict()
        return {**stats, "peak_rss_bytes": peak_rss(), "final_rss_bytes": rss()}

    return Prepared(run, info=rss())


def _dispatcher(dsn: str, settings: OutboxSettings) -> outbox.Dispatcher:
    """Our dispatcher with these settings (connecting only when it runs)."""
    effect = AsyncNoop() if settings.async_effect else Noop()
    return outbox.Dispatcher(dsn, [effect], concurrency=settings.concurrency,
                             batch_size=settings.batch_size, **settings.options)


def probe_worker(spec: ProbeSpec) -> Prepared:
    """``DELETE ... SKIP LOCKED ... RETURNING`` in a loop until nothing is left."""
    conn = psycopg.connect(spec.dsn, autocommit=True)
    query = sql.SQL(PROBE).format(jobs=table("outbox", "jobs"))
    params = {"limit": spec.batch}

    def run() -> int:
        deleted = 0
        deadline = time.monotonic() + spec.timeout
        with conn:
            while time.monotonic() < deadline:
                rows = conn.execute(query, params, prepare=True).fetchall()
                deleted += len(rows)
                if not rows:
                    break
        return deleted

    return Prepared(run)


def sql_ceiling_worker(spec: StatementsSpec) -> Prepared:
    """Our dispatcher's own statements with no dispatcher: ``claim`` then
    ``complete_delete`` (the ledger row written) in a loop on ``spec.connections``
    connections at once, one thread each, nothing performed. What any dispatcher built
    on these statements could reach on this server: the ceiling of the SQL."""
    queries = OutboxQueries("outbox")
    # The batch the dispatcher claims with these settings: its own default when
    # batch_size is None, read from a dispatcher that never runs.
    batch = _dispatcher(spec.dsn, spec.settings).batch_size
    claim = {"effects": [Noop.name], "limit": batch, "lease": 60.0,
             "worker": "sql-ceiling", "after": "{}"}

    def one_round(conn: psycopg.Connection[Any]) -> int:
        rows = conn.execute(queries.claim, claim, prepare=True).fetchall()
        if rows:
            claims = json.dumps([{"id": row.id, "version": row.claim_version,
                                  "result": None} for row in rows])
            conn.execute(queries.complete_delete, {"claims": claims}, prepare=True)
        return len(rows)

    return _statement_loop(spec, one_round)


def floor_tables(dsn: str, *, lease_index: bool = False, held: int = 0) -> None:
    """Build the design floor's table and ledger from the jobs enqueued in ``dsn``; with
    ``lease_index``, index its lease too (``FLOOR_LEASE_INDEX``); with ``held``, claim
    that many of the oldest jobs for an hour, as a fleet holding them in flight would."""
    statements = FLOOR_TABLES.split(";") + ([FLOOR_LEASE_INDEX] if lease_index else [])
    with psycopg.connect(dsn, autocommit=True) as conn:
        for statement in statements:
            conn.execute(floor_sql(statement))
        if held:
            conn.execute(floor_sql(FLOOR_CLAIM),
                         {"limit": held, "lease": 3600.0, "worker": "held"})


def floor_sql(statement: str) -> sql.Composed:
    return sql.SQL(statement).format(jobs=table("outbox", "jobs"), floor=table(*FLOOR_TABLE),
                                     floor_ledger=table(*FLOOR_LEDGER))


def floor_worker(spec: StatementsSpec) -> Prepared:
    """The design floor's claim and fenced completion (see ``FLOOR_TABLES``) in a loop on
    ``spec.connections`` connections at once, one thread each, nothing performed."""
    claim_sql, complete_sql = floor_sql(FLOOR_CLAIM), floor_sql(FLOOR_COMPLETE)
    claim = {"limit": _dispatcher(spec.dsn, spec.settings).batch_size, "lease": 60.0,
             "worker": "floor"}

    def one_round(conn: psycopg.Connection[Any]) -> int:
        rows = conn.execute(claim_sql, claim, prepare=True).fetchall()
        if rows:
            conn.execute(complete_sql, {"ids": [row.id for row in rows],
                                        "versions": [row.claim_version for row in rows]},
                         prepare=True)
        return len(rows)

    return _statement_loop(spec, one_round)


def _statement_loop(spec: StatementsSpec,
                    one_round: Callable[[psycopg.Connection[Any]], int]) -> Prepared:
    """Open ``spec.connections`` connections now (before the clock); the run repeats
    ``one_round`` (it returns the jobs it finished) on each in a thread of its own until
    a round finds nothing or the deadline passes, and returns the jobs finished by all."""
    conns = [psycopg.connect(spec.dsn, autocommit=True, row_factory=namedtuple_row)
             for _ in range(spec.connections)]

    def loop(conn: psycopg.Connection[Any], deadline: float, done: list[int]) -> None:
        with conn:
            while time.monotonic() < deadline:
                finished = one_round(conn)
                if not finished:
                    return
                done.append(finished)

    def run() -> int:
        deadline = time.monotonic() + spec.timeout
        done: list[int] = []
        threads = [threading.Thread(target=loop, args=(conn, deadline, done))
                   for conn in conns]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return sum(done)

    return Prepared(run)


def pgqueuer_worker(spec: PgqueuerSpec) -> Prepared:
    """pgqueuer's QueueManager on asyncpg, in drain mode."""
    loop = asyncio.new_event_loop()
    conn = loop.run_until_complete(asyncpg.connect(**asyncpg_params(spec.dsn)))
    manager = QueueManager(Queries(AsyncpgDriver(conn)))
    performed = [0]

    @manager.entrypoint(PGQUEUER_ENTRYPOINT)  # type: ignore[untyped-decorator,unused-ignore]
    async def noop(job: PgqJob) -> None:
        performed[0] += 1

    async def drain() -> None:
        await manager.run(batch_size=spec.batch_size, mode=QueueExecutionMode.drain,
                          max_concurrent_tasks=spec.max_concurrent_tasks)

    def run() -> int:
        try:
            loop.run_until_complete(asyncio.wait_for(drain(), spec.timeout))
            loop.run_until_complete(conn.close())
        finally:
            loop.close()
        return performed[0]

    return Prepared(run)


def procrastinate_app(dsn: str) -> procrastinate.App:
    """A procrastinate app with the no-op task registered."""
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=dsn))
    app.task(name=PROCRASTINATE_TASK)(_procrastinate_noop)
    return app


async def _procrastinate_noop(n: int) -> None:
    return None


def procrastinate_worker(spec: ProcrastinateSpec) -> Prepared:
    """procrastinate's worker at its best concurrency, returning once caught up."""
    loop = asyncio.new_event_loop()
    app = procrastinate_app(spec.dsn)
    loop.run_until_complete(app.open_async())

    async def drain() -> None:
        await app.run_worker_async(concurrency=spec.concurrency, wait=False,
                                   install_signal_handlers=False)

    def run() -> None:
        try:
            loop.run_until_complete(asyncio.wait_for(drain(), spec.timeout))
            loop.run_until_complete(app.close_async())
        finally:
            loop.close()

    return Prepared(run)
