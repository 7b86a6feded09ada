"""Section ``flows``: what a completion hook costs. Drains of no-op jobs, each in a fresh
database and a process of its own: without a hook (the baseline of the same run), with an
``on_done`` hook that writes one business row in the done transaction, and with that hook
raising for one job in ``RAISE_EVERY``.

Hooked outcomes are written in chunks, one transaction each. While no hook raises, a
chunk takes the fast path: the fenced status changes of the whole chunk in one statement
per kind, then each hook, their statements in one pipeline (one wait for them all), no
savepoint. A hook that raises rolls its chunk back, and the chunk is written again: the
raising job settled from its error in one fenced statement (the hook not called again),
the rest in segments of 32, each the fast path inside a savepoint (a hook raising there
costs its segment). After a chunk with a raise, the next is written hooks first when the
hooks that raised had sent no statement (as this one, which raises before its INSERT):
the jobs locked, the hooks called, then the completions of those whose hook returned, no
rollback for a raise; else in segments from the start. So the "hook" row measures the
fast path, what every hook that does not raise costs; the "hook raising" row measures a
mix where almost every chunk holds a raising hook; its jobs per second count every
settlement in the run (done, or retried with a delay for the ones whose hook raised,
each time it raised). Both use the cheapest possible effect, so the hooks' share of the
cost is as large as it gets.

Each flavour is measured: ``Dispatcher`` with plain hooks (``sync``), and
``AsyncDispatcher`` with ``async def`` hooks on its asyncio connection (``async``), each
against its own no-hook drain of the same round.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

import outbox

from ._db import Server, fresh_database, migrated, settle
from ._effects import AsyncNoop, Noop
from ._procs import Prepared, run_released
from ._results import Row, Section, Target
from ._seed import seed_pending
from ._stats import Figure, ratios

CONCURRENCY = 64
RAISE_EVERY = 100  # the "raising" variant: the hook of one job in this many raises
VARIANTS = ("plain", "hooked", "raising")
FLAVOURS = ("sync", "async")


@dataclass(frozen=True)
class FlowsConfig:
    runs: int
    jobs: int = 20_000
    flavours: tuple[str, ...] = FLAVOURS


@dataclass(frozen=True)
class FlowsWorkerSpec:
    dsn: str
    variant: str
    timeout: float
    flavour: str = "sync"


def _record_paid(tx: outbox.HookTransaction, job: outbox.Job, result: Any) -> None:
    tx.execute("INSERT INTO bench_paid (key) VALUES (%s)", (job.key,))


def _record_paid_or_raise(tx: outbox.HookTransaction, job: outbox.Job, result: Any) -> None:
    if _raises(job):
        raise RuntimeError("the order is locked")  # retried with backoff: not done here
    _record_paid(tx, job, result)


async def _record_paid_async(tx: outbox.AsyncHookTransaction, job: outbox.Job,
                             result: Any) -> None:
    await tx.execute("INSERT INTO bench_paid (key) VALUES (%s)", (job.key,))


async def _record_paid_or_raise_async(tx: outbox.AsyncHookTransaction, job: outbox.Job,
                                      result: Any) -> None:
    if _raises(job):
        raise RuntimeError("the order is locked")
    await _record_paid_async(tx, job, result)


def _raises(job: outbox.Job) -> bool:
    return int(job.key.rpartition("-")[2]) % RAISE_EVERY == 0


HOOKS: dict[str, dict[str, Any]] = {
    "sync": {"plain": None, "hooked": _record_paid, "raising": _record_paid_or_raise},
    "async": {"plain": None, "hooked": _record_paid_async,
              "raising": _record_paid_or_raise_async},
}


def flows_worker(spec: FlowsWorkerSpec) -> Prepared:
    """A dispatcher of the flavour with the no-op effect, with the variant's on_done
    hook (or none): ``Dispatcher`` and a plain hook, or ``AsyncDispatcher`` and an
    ``async def`` one."""
    hook = HOOKS[spec.flavour][spec.variant]
    if spec.variant == "raising":  # a warning per raising hook is the point, not news
        logging.getLogger("outbox").setLevel(logging.ERROR)
    on_done = {Noop.name: hook} if hook else None
    if spec.flavour == "async":
        flowing = outbox.AsyncDispatcher(spec.dsn, [AsyncNoop()], concurrency=CONCURRENCY,
                                         on_done=on_done)

        def run_async() -> dict[str, Any]:
            stats = asyncio.run(flowing.run_until_idle(timeout=spec.timeout))
            return stats.as_dict()

        return Prepared(run_async)
    dispatcher = outbox.Dispatcher(spec.dsn, [Noop()], concurrency=CONCURRENCY,
                                   on_done=on_done)

    def run() -> dict[str, Any]:
        return dispatcher.run_until_idle(timeout=spec.timeout).as_dict()

    return Prepared(run)


def measure(server: Server, config: FlowsConfig, variant: str, flavour: str = "sync") -> float:
    """One drain; jobs settled per second."""
    with fresh_database(server, "flows") as dsn:
        migrated(dsn)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE TABLE bench_paid (key text NOT NULL)"))
        seed_pending(dsn, config.jobs, prefix="flow-", effect=Noop.name)
        settle(dsn)
        timeout = 60.0 + config.jobs / 100
        released = run_released(flows_worker, [FlowsWorkerSpec(dsn, variant, timeout, flavour)],
                                timeout=timeout + 30)
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute("SELECT count(*) FROM bench_paid").fetchone()
    stats = released.results[0]
    done, retried = int(stats["done"]), int(stats["retried"])
    written = row[0] if row else 0
    raised = config.jobs // RAISE_EVERY if variant == "raising" else 0
    expected_rows = 0 if variant == "plain" else config.jobs - raised
    # A raising job comes back after its (short) backoff and raises again, maybe within
    # the run: it counts once per settlement.
    if (done, written) != (config.jobs - raised, expected_rows) or retried < raised:
        raise AssertionError(f"flows run ({flavour} {variant}): {done} done, {retried} retried, "
                             f"{written} hook rows, of {config.jobs} jobs")
    return (done + retried) / released.seconds


def run(server: Server, config: FlowsConfig) -> Section:
    """The three variants of each flavour, ``config.runs`` times each, interleaved."""
    measured: dict[str, dict[str, list[float]]] = {
        flavour: {variant: [] for variant in VARIANTS} for flavour in config.flavours}
    for _ in range(config.runs):
        for flavour in config.flavours:
            for variant in VARIANTS:
                measured[flavour][variant].append(measure(server, config, variant, flavour))
    rows = [row for flavour in config.flavours for row in _rows(config, flavour,
                                                                 measured[flavour])]
    settings = {"dispatcher": f"Dispatcher (sync) or AsyncDispatcher (async), concurrency "
                f"{CONCURRENCY}, other settings default",
                "hook": "on_done: one INSERT in the done transaction (async: an async def "
                "hook awaiting it)",
                "raising": f"the hook raises RuntimeError for keys divisible by {RAISE_EVERY}"}
    return Section("flows", rows, raw={"config": vars(config), **measured},
                   settings=settings)


def _rows(config: FlowsConfig, flavour: str, measured: dict[str, list[float]]) -> list[Row]:
    plain = measured["plain"]
    who = "Dispatcher" if flavour == "sync" else "AsyncDispatcher, async def hooks"
    name = f"{who}, {config.jobs // 1000}k no-op jobs, 1 process, concurrency {CONCURRENCY}"
    return [
        Row("flows", f"{name}, on_done writing one row (fast path: no savepoint, the hooks'"
            " statements pipelined)", "jobs/s",
            Figure.of(measured["hooked"]), "no hook", Figure.of(plain),
            ratios(measured["hooked"], plain)),
        Row("flows", f"{name}, the same hook raising for 1 job in {RAISE_EVERY} (the raising "
            "job settled from its error; the next chunks written hooks first)", "jobs/s",
            Figure.of(measured["raising"]),
            "no hook", Figure.of(plain), ratios(measured["raising"], plain)),
        Row("flows", f"{name}, 1 hook in {RAISE_EVERY} raising, against none raising",
            "jobs/s", Figure.of(measured["raising"]), "the hook, none raising",
            Figure.of(measured["hooked"]), ratios(measured["raising"], measured["hooked"]),
            Target(">=", 0.5)),
        Row("flows", f"{name}, on_done writing one row, against no hook", "jobs/s",
            Figure.of(measured["hooked"]), "no hook", Figure.of(plain),
            ratios(measured["hooked"], plain), Target(">=", 0.6)),
    ]
