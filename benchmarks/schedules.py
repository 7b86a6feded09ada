"""Section ``schedules``: what schedules (``outbox.Schedule``) cost a dispatcher.

(a) The claim rate with 10,000 schedules: a drain of no-op jobs by one
``Dispatcher.run()`` process (its scheduler part making a pass every second beside the
claimer), with 10,000 stored schedules none of which is due during the drain (the steady
state of a large deployment: each pass reads only the due ones, through the partial index
``schedules_due``), against the same drain with no schedule, interleaved in the same run.

(b) 10,000 schedules due at once (each one slot: the current hour): ``run_until_idle``
enqueues the 10,000 slots (one pass, 100 transactions of 100 schedules) and performs
them, against ``run_until_idle`` draining the same number of jobs enqueued beforehand:
what the scheduler's enqueue adds to a drain of its jobs.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

import outbox

from ._db import Server, fresh_database, migrated, settle, table
from ._effects import NOOP, Noop
from ._procs import Prepared, run_released
from ._results import Row, Section
from ._seed import seed_pending
from ._stats import Figure, ratios

CONCURRENCY = 64
SCHEDULES = 10_000
POLL = 0.02  # seconds between two looks at the ledger while run() drains

# 10,000 stored schedules of the no-op effect: every=3600 with the current hour due
# ("due"), or a day's period whose next slot is a day away ("idle").
_SEED_SCHEDULES = """
INSERT INTO {schedules} (name, effect, definition, source, next_slot)
SELECT 'bench-' || g, %(effect)s::text,
       jsonb_build_object('effect', %(effect)s::text, 'every', %(every)s::float8,
                          'payload', '{{}}'::jsonb, 'timezone', 'UTC', 'catch_up', 'latest',
                          'priority', 0),
       'stored', CASE WHEN %(due)s::boolean THEN date_trunc('hour', now())
                      ELSE now() + interval '1 day' END
FROM generate_series(1, %(n)s) AS g
"""


@dataclass(frozen=True)
class SchedulesConfig:
    runs: int
    jobs: int = 20_000
    schedules: int = SCHEDULES


@dataclass(frozen=True)
class RunSpec:
    """A ``run()`` drain of ``jobs`` ledger rows."""

    dsn: str
    jobs: int
    timeout: float


@dataclass(frozen=True)
class IdleSpec:
    dsn: str
    timeout: float


def run_worker(spec: RunSpec) -> Prepared:
    """``Dispatcher.run()`` on a thread until the ledger holds ``spec.jobs`` rows."""
    dispatcher = outbox.Dispatcher(spec.dsn, [Noop()], concurrency=CONCURRENCY, retention=0)
    watcher = psycopg.connect(spec.dsn, autocommit=True)
    count = sql.SQL("SELECT count(*) FROM {}").format(table("outbox", "effect_results"))

    def run() -> dict[str, Any]:
        runner = threading.Thread(target=dispatcher.run, name="bench-run")
        runner.start()
        deadline = time.monotonic() + spec.timeout
        try:
            with watcher:
                while time.monotonic() < deadline:
                    row = watcher.execute(count).fetchone()
                    if row is not None and row[0] >= spec.jobs:
                        break
                    time.sleep(POLL)
                else:
                    raise TimeoutError("the drain did not finish in time")
        finally:
            dispatcher.stop()
            runner.join(60)
        return dispatcher.stats.as_dict()

    return Prepared(run)


def idle_worker(spec: IdleSpec) -> Prepared:
    """``Dispatcher.run_until_idle()``: the due slots enqueued, then everything drained."""
    dispatcher = outbox.Dispatcher(spec.dsn, [Noop()], concurrency=CONCURRENCY, retention=0)

    def run() -> dict[str, Any]:
        return dispatcher.run_until_idle(timeout=spec.timeout).as_dict()

    return Prepared(run)


def _seed_schedules(dsn: str, n: int, *, due: bool) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL(_SEED_SCHEDULES).format(schedules=table("outbox", "schedules")),
                     {"effect": NOOP, "every": 3600.0 if due else 86400.0, "due": due,
                      "n": n})


def _ledger(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(
            table("outbox", "effect_results"))).fetchone()
    return int(row[0]) if row else 0


def measure_drain(server: Server, config: SchedulesConfig, schedules: int) -> float:
    """(a) One ``run()`` drain of ``config.jobs`` jobs beside ``schedules`` idle ones;
    jobs/s."""
    with fresh_database(server, "schedules") as dsn:
        migrated(dsn)
        seed_pending(dsn, config.jobs, prefix="job-")
        if schedules:
            _seed_schedules(dsn, schedules, due=False)
        settle(dsn)
        timeout = 60.0 + config.jobs / 200
        released = run_released(run_worker, [RunSpec(dsn, config.jobs, timeout)],
                                timeout=timeout + 30)
        if _ledger(dsn) != config.jobs:
            raise AssertionError("the drain left jobs behind")
    return config.jobs / released.seconds


def measure_due(server: Server, config: SchedulesConfig, *, scheduled: bool) -> float:
    """(b) ``run_until_idle`` over ``config.schedules`` due slots (``scheduled``) or as
    many jobs enqueued beforehand; jobs/s."""
    with fresh_database(server, "schedules_due") as dsn:
        migrated(dsn)
        if scheduled:
            _seed_schedules(dsn, config.schedules, due=True)
        else:
            seed_pending(dsn, config.schedules, prefix="job-")
        settle(dsn)
        timeout = 60.0 + config.schedules / 200
        released = run_released(idle_worker, [IdleSpec(dsn, timeout)], timeout=timeout + 30)
        if _ledger(dsn) != config.schedules:
            raise AssertionError(f"{_ledger(dsn)} jobs done of {config.schedules}")
    return config.schedules / released.seconds


def run(server: Server, config: SchedulesConfig) -> Section:
    """Both measures, ``config.runs`` times each, their variants interleaved."""
    measured: dict[str, list[float]] = {"none": [], "idle": [], "enqueued": [], "due": []}
    for _ in range(config.runs):
        measured["none"].append(measure_drain(server, config, 0))
        measured["idle"].append(measure_drain(server, config, config.schedules))
        measured["enqueued"].append(measure_due(server, config, scheduled=False))
        measured["due"].append(measure_due(server, config, scheduled=True))
    n = f"{config.schedules:,}"
    rows = [
        Row("schedules", f"{config.jobs // 1000}k no-op jobs drained by run(), 1 process, "
            f"beside {n} schedules not due", "jobs/s", Figure.of(measured["idle"]),
            "no schedule", Figure.of(measured["none"]),
            ratios(measured["idle"], measured["none"])),
        Row("schedules", f"{n} schedules due at once: slots enqueued and performed by "
            "run_until_idle", "jobs/s", Figure.of(measured["due"]),
            f"{n} jobs enqueued before", Figure.of(measured["enqueued"]),
            ratios(measured["due"], measured["enqueued"])),
    ]
    settings = {"dispatcher": f"Dispatcher, concurrency {CONCURRENCY}, retention=0",
                "schedules": "stored rows, every=86400 (not due) or every=3600 with the "
                             "current hour due"}
    return Section("schedules", rows, raw={"config": vars(config), **measured},
                   settings=settings)
