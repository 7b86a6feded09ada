"""What runs inside each drain worker process, one setup function per system.

Each setup connects and builds everything before it returns; what it returns is what
the clock times. Every loop is bounded by a deadline.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
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
    dsn: str
    settings: OutboxSettings
    timeout: float


@dataclass(frozen=True)
class SqlCeilingSpec:
    dsn: str
    settings: OutboxSettings  # claims as many jobs at a time as the dispatcher would
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


def sql_ceiling_worker(spec: SqlCeilingSpec) -> Prepared:
    """Our dispatcher's own statements with no dispatcher: ``claim`` then
    ``complete_delete`` (the ledger row written) in a loop on ``spec.connections``
    connections at once, one thread each, nothing performed. What any dispatcher built
    on these statements could reach on this server: the ceiling of the SQL."""
    queries = OutboxQueries("outbox")
    conns = [psycopg.connect(spec.dsn, autocommit=True, row_factory=namedtuple_row)
             for _ in range(spec.connections)]
    # The batch the dispatcher claims with these settings: its own default when
    # batch_size is None, read from a dispatcher that never runs.
    batch = _dispatcher(spec.dsn, spec.settings).batch_size
    claim = {"effects": [Noop.name], "limit": batch, "lease": 60.0,
             "worker": "sql-ceiling", "after": "{}"}

    def loop(conn: psycopg.Connection[Any], deadline: float, done: list[int]) -> None:
        with conn:
            while time.monotonic() < deadline:
                rows = conn.execute(queries.claim, claim, prepare=True).fetchall()
                if not rows:
                    return
                claims = json.dumps([{"id": row.id, "version": row.claim_version,
                                      "result": None} for row in rows])
                conn.execute(queries.complete_delete, {"claims": claims}, prepare=True)
                done.append(len(rows))

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
