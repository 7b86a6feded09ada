"""Section ``async``: ``AsyncDispatcher`` with async effects that each ``await
asyncio.sleep(0.05)`` at concurrency 1000, against the ideal, concurrency / 0.05 s.

Each run drains freshly seeded jobs in a process of its own. Two windows are timed: the
wall clock from release to ``run_until_idle`` returning (connecting, the schema check and
the final "anything left?" query included), and the active window, from the start of the
first claim to the last outcome recorded (through the dispatcher's observer). The effect
counts the performs in flight at once: the peak must never pass the concurrency.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import outbox
from outbox.observe import AttemptOutcome, DispatchObserver

from ._db import Server, fresh_database, migrated, settle
from ._procs import Prepared, run_released
from ._results import Row, Section, Target
from ._seed import seed_pending
from ._stats import Figure, ratios

SLEEP = "bench.sleep"


@dataclass(frozen=True)
class AsyncConfig:
    runs: int
    sizes: tuple[int, ...] = (1000, 10_000, 60_000)
    concurrency: int = 1000
    delay: float = 0.05

    @property
    def ideal(self) -> float:
        return self.concurrency / self.delay


@dataclass(frozen=True)
class AsyncWorkerSpec:
    dsn: str
    jobs: int
    concurrency: int
    delay: float
    timeout: float


class Sleep(outbox.Effect):
    """``await asyncio.sleep(delay)``; counts the performs in flight and their peak."""

    name = SLEEP

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.in_flight = 0
        self.peak = 0

    async def perform(self, job: outbox.Job) -> None:
        self.in_flight += 1  # one event loop: no lock needed
        self.peak = max(self.peak, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
        finally:
            self.in_flight -= 1


class Window(DispatchObserver):
    """The active window: first claim started -> last outcome recorded."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.first_claim: float | None = None
        self.last_outcome = 0.0

    def claimed(self, duration: float, waits: Sequence[tuple[str, float]]) -> None:
        if waits and self.first_claim is None:
            self.first_claim = time.perf_counter() - duration

    def attempt_finished(self, effect: str, outcome: AttemptOutcome, duration: float) -> None:
        self.last_outcome = time.perf_counter()


def async_worker(spec: AsyncWorkerSpec) -> Prepared:
    """An AsyncDispatcher with the sleeping effect, draining what was seeded."""
    effect, window = Sleep(spec.delay), Window()
    dispatcher = outbox.AsyncDispatcher(spec.dsn, [effect], concurrency=spec.concurrency,
                                        observer=window)

    def run() -> dict[str, Any]:
        stats = asyncio.run(dispatcher.run_until_idle(timeout=spec.timeout))
        active = window.last_outcome - (window.first_claim or window.last_outcome)
        return {**stats.as_dict(), "peak": effect.peak, "active_seconds": active}

    return Prepared(run)


def measure(server: Server, config: AsyncConfig, jobs: int) -> dict[str, Any]:
    """One drain of ``jobs``; jobs/s over both windows, and the peak in flight."""
    with fresh_database(server, "async") as dsn:
        migrated(dsn)
        seed_pending(dsn, jobs, prefix="sleep-", effect=SLEEP)
        settle(dsn)
        timeout = 60.0 + jobs * config.delay
        released = run_released(
            async_worker, [AsyncWorkerSpec(dsn, jobs, config.concurrency, config.delay,
                                           timeout)], timeout=timeout + 30)
    result = released.results[0]
    if result["done"] != jobs:
        raise AssertionError(f"async run finished {result['done']} of {jobs} jobs")
    return {"jobs": jobs, "ideal": config.ideal, "peak": result["peak"],
            "wall": jobs / released.seconds, "active": jobs / result["active_seconds"],
            "stats": result}


def _rows(config: AsyncConfig, results: list[dict[str, Any]]) -> list[Row]:
    rows = []
    ideal_name = f"ideal {config.concurrency}/{config.delay:g}s"
    for jobs in config.sizes:
        mine = [r for r in results if r["jobs"] == jobs]
        if not mine:
            continue
        ideal = [r["ideal"] for r in mine]
        name = f"AsyncDispatcher, {jobs:,} x sleep({config.delay:g}), concurrency " \
               f"{config.concurrency}"
        active, wall = [r["active"] for r in mine], [r["wall"] for r in mine]
        peak = Figure.of([r["peak"] for r in mine])
        rows.append(Row("async", f"{name}, first claim to last outcome", "jobs/s",
                        Figure.of(active), ideal_name, Figure.of(ideal), ratios(active, ideal),
                        Target(">=", 0.8)))
        rows.append(Row("async", f"{name}, wall (connect to return)", "jobs/s",
                        Figure.of(wall), ideal_name, Figure.of(ideal), ratios(wall, ideal),
                        Target(">=", 0.8) if jobs > config.concurrency else None))
        rows.append(Row("async", f"{name}, peak performs in flight", "performs", peak,
                        target=Target("<=", config.concurrency, on="value")))
    return rows


def run(server: Server, config: AsyncConfig) -> Section:
    """Every size ``config.runs`` times, interleaved."""
    results = [measure(server, config, jobs)
               for _ in range(config.runs) for jobs in config.sizes]
    settings = {"dispatcher": f"AsyncDispatcher, concurrency {config.concurrency}, other "
                "settings default", "effect": f"async def perform: await asyncio.sleep("
                f"{config.delay:g})"}
    return Section("async", _rows(config, results),
                   raw={"config": vars(config), "runs": results}, settings=settings)
