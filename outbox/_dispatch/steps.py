"""Database work written once for threads and asyncio: steps and their two drivers.

A step is a generator that yields the ``Statement`` it wants run and receives its rows
(or, thrown into it, the error the statement raised); what it returns is the step's
result. The claimer's and recorder's logic are steps, so ``Dispatcher`` (a blocking
connection per thread) and ``AsyncDispatcher`` (asyncio connections) run the same
decisions and differ only in the driver: ``run`` or ``run_async``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["Rows", "Statement", "Step", "run", "run_async"]

T = TypeVar("T")
Rows = list[tuple[Any, ...]]


@dataclass(frozen=True, slots=True)
class Statement:
    """One statement to run in its own transaction. With ``count``, the rows received
    are ``[(rowcount,)]`` (for a DELETE that returns nothing)."""

    query: str
    params: Mapping[str, Any]
    count: bool = False


Step = Generator[Statement, Rows, T]


def run(step: Step[T], execute: Callable[[Statement], Rows]) -> T:
    """Drive ``step`` with a blocking ``execute``."""
    try:
        statement = next(step)
        while True:
            try:
                rows = execute(statement)
            except Exception as exc:
                statement = step.throw(exc)
            else:
                statement = step.send(rows)
    except StopIteration as done:
        result: T = done.value
        return result


async def run_async(step: Step[T], execute: Callable[[Statement], Awaitable[Rows]]) -> T:
    """Drive ``step`` with an asyncio ``execute``."""
    try:
        statement = next(step)
        while True:
            try:
                rows = await execute(statement)
            except Exception as exc:
                statement = step.throw(exc)
            else:
                statement = step.send(rows)
    except StopIteration as done:
        result: T = done.value
        return result
