"""Section ``flows``: what a completion hook costs. Drains of no-op jobs, each in a fresh
database and a process of its own, with and without an ``on_done`` hook that writes one
business row in the done transaction; the plain drain is the baseline of the same run.

Jobs with hooks are recorded one savepoint each (complete, hook, release) inside one
transaction per batch, where plain jobs share one statement per batch; the ratio says
what that costs with the cheapest possible effect, so it is the worst case.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

import outbox

from ._db import Server, fresh_database, migrated, settle
from ._effects import Noop
from ._procs import Prepared, run_released
from ._results import Row, Section
from ._seed import seed_pending
from ._stats import Figure, ratios

CONCURRENCY = 64


@dataclass(frozen=True)
class FlowsConfig:
    runs: int
    jobs: int = 20_000


@dataclass(frozen=True)
class FlowsWorkerSpec:
    dsn: str
    hooked: bool
    timeout: float


def _record_paid(tx: outbox.HookTransaction, job: outbox.Job, result: Any) -> None:
    tx.execute("INSERT INTO bench_paid (key) VALUES (%s)", (job.key,))


def flows_worker(spec: FlowsWorkerSpec) -> Prepared:
    """A Dispatcher with the no-op effect, with or without the on_done hook."""
    dispatcher = outbox.Dispatcher(spec.dsn, [Noop()], concurrency=CONCURRENCY,
                                   on_done={Noop.name: _record_paid} if spec.hooked else None)

    def run() -> dict[str, Any]:
        return dispatcher.run_until_idle(timeout=spec.timeout).as_dict()

    return Prepared(run)


def measure(server: Server, config: FlowsConfig, hooked: bool) -> float:
    """One drain; jobs/s."""
    with fresh_database(server, "flows") as dsn:
        migrated(dsn)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE TABLE bench_paid (key text NOT NULL)"))
        seed_pending(dsn, config.jobs, prefix="flow-", effect=Noop.name)
        settle(dsn)
        timeout = 60.0 + config.jobs / 100
        released = run_released(flows_worker, [FlowsWorkerSpec(dsn, hooked, timeout)],
                                timeout=timeout + 30)
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute("SELECT count(*) FROM bench_paid").fetchone()
    done = released.results[0]["done"]
    written = row[0] if row else 0
    if done != config.jobs or written != (config.jobs if hooked else 0):
        raise AssertionError(f"flows run: {done} done, {written} hook rows, "
                             f"of {config.jobs} jobs")
    return config.jobs / released.seconds


def run(server: Server, config: FlowsConfig) -> Section:
    """Plain and hooked drains, ``config.runs`` times each, interleaved."""
    plain: list[float] = []
    hooked: list[float] = []
    for _ in range(config.runs):
        plain.append(measure(server, config, hooked=False))
        hooked.append(measure(server, config, hooked=True))
    name = f"{config.jobs // 1000}k no-op jobs, 1 process, concurrency {CONCURRENCY}"
    rows = [
        Row("flows", f"{name}, on_done writing one row", "jobs/s", Figure.of(hooked),
            "no hook", Figure.of(plain), ratios(hooked, plain)),
    ]
    settings = {"dispatcher": f"Dispatcher, concurrency {CONCURRENCY}, other settings "
                "default", "hook": "on_done: one INSERT in the done transaction"}
    return Section("flows", rows, raw={"config": vars(config), "plain": plain,
                                       "hooked": hooked}, settings=settings)
