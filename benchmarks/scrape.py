"""What reading the queue costs as the backlog grows: the Prometheus scrape
(``DatabaseCollector``, a connection and one read-only transaction), the dashboard's
overview (``GET /``) and its job list (``GET /jobs``), each at a small backlog and at a
large one (``python -m benchmarks.scrape``, or ``make bench ARGS="--only scrape"``).

Two schemas in one fresh database, filled once with ``generate_series``: ``small`` holds
``--small`` due jobs (1,000), ``big`` the same plus ``--backlog`` more (300,000) over
``--groups`` groups (2,000); both hold the same ledger history (``--ledger`` rows) and
the same history of done jobs, so only the backlog differs; a dispatcher's row serves
their effects, as in a deployment. Both are VACUUM ANALYZEd.
Each run times every reading ``--repeats`` times on each schema, alternating, and keeps
the median; the figure is the median of ``--runs`` runs with its spread, and the ratio
big / small is taken run by run. Target: ratio <= 3 for each reading.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psycopg
from psycopg import sql

import outbox
from outbox.metrics import DatabaseCollector
from outbox.web import create_app

from ._db import Server, fresh_database, server
from ._results import Row, Section, Target, environment, render, write_json
from ._stats import Figure, ratios

SCHEMAS = ("small", "big")
RESULTS = Path(__file__).resolve().parent / "results"
READINGS = ("scrape", "overview", "job list")


@dataclass(frozen=True)
class ScrapeConfig:
    """Sizes: the small backlog, what the big one adds, its groups, the shared history."""

    runs: int = 3
    small: int = 1_000
    backlog: int = 300_000
    groups: int = 2_000
    ledger: int = 100_000
    done: int = 20_000
    repeats: int = 5


def _fill(conn: psycopg.Connection[Any], schema: str, prefix: str, jobs: int, *,
          status: str = "pending", groups: int = 0, effects: int = 3) -> None:
    """``jobs`` rows of ``status`` (due since a minute ago; done ones with a ledger row)."""
    conn.execute(sql.SQL("""
        INSERT INTO {jobs} (effect, key, payload, fingerprint, status, group_key,
                            available_at, updated_at, created_at)
        SELECT 'bench.e' || (n %% %(effects)s), %(prefix)s || n, '{{}}'::jsonb, 'f',
               %(status)s, CASE WHEN %(groups)s > 0 THEN 'g' || (n %% %(groups)s) END,
               now() - interval '1 minute', now() - interval '2 hours',
               now() - interval '2 hours'
        FROM generate_series(1, %(jobs)s) AS n""").format(
        jobs=sql.Identifier(schema, "jobs")),
        {"prefix": prefix, "jobs": jobs, "status": status, "groups": groups,
         "effects": effects})


def _ledger(conn: psycopg.Connection[Any], schema: str, rows: int) -> None:
    conn.execute(sql.SQL("""
        INSERT INTO {ledger} (key, effect, job_id, claim_version, result, fingerprint,
                              recorded_at)
        SELECT 'old-' || n, 'bench.e' || (n %% 3), n + 10000000, 1, NULL, 'f',
               now() - (n %% 86400) * interval '1 second'
        FROM generate_series(1, %(rows)s) AS n""").format(
        ledger=sql.Identifier(schema, "effect_results")), {"rows": rows})


def seed(dsn: str, config: ScrapeConfig) -> None:
    """Both schemas, filled and VACUUM ANALYZEd."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for schema in SCHEMAS:
            outbox.migrate(conn, schema=schema)
            with conn.transaction():
                # The effects are served (as in a deployment): a dispatcher's row
                conn.execute(sql.SQL(
                    "INSERT INTO {} (worker_id, effects, expires_at) VALUES "
                    "('bench', ARRAY['bench.e0', 'bench.e1', 'bench.e2'], "
                    "now() + interval '1 day')").format(
                    sql.Identifier(schema, "dispatchers")))
                _ledger(conn, schema, config.ledger)
                _fill(conn, schema, "done-", config.done, status="done")
                _fill(conn, schema, "due-", config.small, groups=20)
                if schema == "big":
                    _fill(conn, schema, "backlog-", config.backlog, groups=config.groups)
            for table in ("jobs", "effect_results"):
                conn.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(schema, table)))


def _scrape(dsn: str, schema: str) -> Callable[[], Awaitable[None]]:
    collector = DatabaseCollector(dsn, schema)

    async def once() -> None:
        families = await asyncio.to_thread(lambda: list(collector.collect()))
        up = next(f for f in families if f.name == "outbox_database_up")
        if up.samples[0].value != 1:
            raise RuntimeError(f"the scrape of schema {schema} failed")
    return once


def _page(client: httpx.AsyncClient, path: str) -> Callable[[], Awaitable[None]]:
    async def once() -> None:
        response = await client.get(path)
        response.raise_for_status()
    return once


async def _median(reading: Callable[[], Awaitable[None]], repeats: int) -> float:
    await reading()  # warm: the pool's connection, the prepared plans
    taken = []
    for _ in range(repeats):
        started = time.perf_counter()
        await reading()
        taken.append(time.perf_counter() - started)
    return statistics.median(taken)


async def _measure(dsn: str, config: ScrapeConfig) -> dict[str, dict[str, list[float]]]:
    found: dict[str, dict[str, list[float]]] = {
        reading: {schema: [] for schema in SCHEMAS} for reading in READINGS}
    apps = {schema: create_app(dsn, schema=schema, read_only=True) for schema in SCHEMAS}
    clients = {schema: httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://bench") for schema, app in apps.items()}
    try:
        for _ in range(config.runs):
            for schema in SCHEMAS:  # alternating: load from elsewhere falls on both
                readings = {"scrape": _scrape(dsn, schema),
                            "overview": _page(clients[schema], "/"),
                            "job list": _page(clients[schema], "/jobs")}
                for reading, once in readings.items():
                    found[reading][schema].append(await _median(once, config.repeats))
    finally:
        for schema in SCHEMAS:
            await clients[schema].aclose()
            await apps[schema].state.outbox.close()
    return found


def run(srv: Server, config: ScrapeConfig) -> Section:
    """Seed both schemas in a fresh database, time every reading on each."""
    with fresh_database(srv, "scrape") as dsn:
        seed(dsn, config)
        found = asyncio.run(_measure(dsn, config))
    big = f"{config.small + config.backlog:,} due jobs over {config.groups:,} groups"
    rows = [Row("scrape", f"{reading} at {big}", "ms",
                Figure.of([1000 * s for s in found[reading]["big"]]),
                f"at {config.small:,} due jobs",
                Figure.of([1000 * s for s in found[reading]["small"]]),
                ratios(found[reading]["big"], found[reading]["small"]),
                Target("<=", 3.0)) for reading in READINGS]
    settings = {"history": f"{config.ledger:,} ledger rows and {config.done:,} done jobs "
                "in each schema", "repeats": f"median of {config.repeats} readings a run"}
    return Section("scrape", rows, raw={"config": asdict(config), "seconds": found},
                   settings=settings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = ScrapeConfig()
    parser.add_argument("--dsn", default=None, help="a server to use (needs CREATEDB)")
    parser.add_argument("--runs", type=int, default=defaults.runs)
    parser.add_argument("--small", type=int, default=defaults.small)
    parser.add_argument("--backlog", type=int, default=defaults.backlog)
    parser.add_argument("--groups", type=int, default=defaults.groups)
    parser.add_argument("--ledger", type=int, default=defaults.ledger)
    parser.add_argument("--repeats", type=int, default=defaults.repeats)
    parser.add_argument("--out", type=Path, default=None,
                        help="the JSON file (default benchmarks/results/scrape-<UTC>.json)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    config = ScrapeConfig(runs=args.runs, small=args.small, backlog=args.backlog,
                          groups=args.groups, ledger=args.ledger, repeats=args.repeats)
    started = datetime.now(UTC)
    with server(args.dsn) as srv:
        env = environment(srv.version(), srv.settings(("shared_buffers", "max_connections")))
        section = run(srv, config)
        section.load = {"after": os.getloadavg()}
    render([section], config.runs)
    out = args.out or RESULTS / f"scrape-{started:%Y%m%dT%H%M%SZ}.json"
    write_json(out, [section], asdict(config), env, started,
               (datetime.now(UTC) - started).total_seconds())
    print(f"results: {out}")


if __name__ == "__main__":
    main()
