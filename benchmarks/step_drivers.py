"""What driving a step costs, by driver: ``python -m benchmarks.step_drivers [--runs 7]
[--steps 200000]``.

A step of the enqueue's shape (one ``Statement``, its rows answered, a result returned)
driven to its end with an executor that answers at once (no database: only the driving
is measured), by:

- ``run``: ``outbox._steps.run``, the blocking driver;
- ``one driver, blocking``: the one driver both flavours could share, an ``async def``
  loop (``run_async``'s), driven without an event loop: each answer wrapped in a
  coroutine that returns at once, the driver's coroutine sent ``None`` once;
- ``one driver, awaitable-or-not``: one ``async def`` loop that awaits what the executor
  answers only when it is awaitable (``inspect.isawaitable``), driven the same way;
- ``run_async``: ``outbox._steps.run_async`` on an event loop, with an ``async def``
  executor, and ``one driver, asyncio``: the awaitable-or-not loop there.

The variants alternate within each run; prints ns a step, median (min..max) over the
runs, and each variant against ``run`` (the blocking ones) or ``run_async`` (the asyncio
ones) of the same run. No database, no network: a quiet machine is not needed, but a
loaded one widens the ranges.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import statistics
import time
from collections.abc import Awaitable, Callable, Generator
from typing import Any

from outbox._steps import Statement, run, run_async

STATEMENT = Statement("INSERT ...", {"key": "k"})
ROWS: list[Any] = [(1,)]


def step() -> Generator[Statement, list[Any], int]:
    rows = yield STATEMENT
    result: int = rows[0][0]
    return result


def answer(statement: Statement) -> list[Any]:
    return ROWS


async def answer_async(statement: Statement) -> list[Any]:
    return ROWS


# -- the candidates: one driver for both flavours --------------------------------------------


async def _one(step: Generator[Any, Any, Any],
               execute: Callable[[Any], Awaitable[Any]]) -> Any:
    try:
        instruction = next(step)
        while True:
            try:
                answer = await execute(instruction)
            except Exception as exc:
                instruction = step.throw(exc)
            else:
                instruction = step.send(answer)
    except StopIteration as done:
        return done.value


def _blocking(coroutine: Any) -> Any:
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    raise RuntimeError("a blocking executor suspended")


def one_blocking(step: Generator[Any, Any, Any], execute: Callable[[Any], Any]) -> Any:
    async def now(instruction: Any) -> Any:
        return execute(instruction)

    return _blocking(_one(step, now))


async def _either(step: Generator[Any, Any, Any], execute: Callable[[Any], Any]) -> Any:
    try:
        instruction = next(step)
        while True:
            try:
                answer = execute(instruction)
                if inspect.isawaitable(answer):
                    answer = await answer
            except Exception as exc:
                instruction = step.throw(exc)
            else:
                instruction = step.send(answer)
    except StopIteration as done:
        return done.value


def one_either(step: Generator[Any, Any, Any], execute: Callable[[Any], Any]) -> Any:
    return _blocking(_either(step, execute))


# -- measuring --------------------------------------------------------------------------------


def _timed(drive: Callable[[], None], steps: int) -> float:
    started = time.perf_counter_ns()
    drive()
    return (time.perf_counter_ns() - started) / steps


def blocking_variants(steps: int) -> dict[str, Callable[[], None]]:
    def today() -> None:
        for _ in range(steps):
            run(step(), answer)

    def one() -> None:
        for _ in range(steps):
            one_blocking(step(), answer)

    def either() -> None:
        for _ in range(steps):
            one_either(step(), answer)

    return {"run": today, "one driver, blocking": one,
            "one driver, awaitable-or-not": either}


def asyncio_variants(steps: int) -> dict[str, Callable[[], None]]:
    async def today() -> None:
        for _ in range(steps):
            await run_async(step(), answer_async)

    async def either() -> None:
        for _ in range(steps):
            await _either(step(), answer_async)

    return {"run_async": lambda: asyncio.run(today()),
            "one driver, asyncio": lambda: asyncio.run(either())}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--steps", type=int, default=200_000)
    args = parser.parse_args(argv)
    for baseline, variants in (("run", blocking_variants(args.steps)),
                               ("run_async", asyncio_variants(args.steps))):
        per_run: dict[str, list[float]] = {name: [] for name in variants}
        ratios: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.runs):
            this_run = {name: _timed(drive, args.steps) for name, drive in variants.items()}
            for name, cost in this_run.items():
                per_run[name].append(cost)
                ratios[name].append(cost / this_run[baseline])
        for name in variants:
            ns, ratio = per_run[name], ratios[name]
            print(f"{name:32} {statistics.median(ns):7.0f} ns a step "
                  f"({min(ns):.0f}..{max(ns):.0f}), against {baseline}: "
                  f"{statistics.median(ratio):.2f} ({min(ratio):.2f}..{max(ratio):.2f})")


if __name__ == "__main__":
    main()
