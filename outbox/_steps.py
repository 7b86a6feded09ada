"""Database work written once for every caller and both flavours: steps, and their two
drivers (psycopg's habit: one generator protocol, a blocking wait and an asyncio one).

A step is a generator. It yields an instruction, is sent the answer, and returns its
result::

    rows = yield Statement(query, params)      # the rows (or the error, thrown in)
    found = yield Statement(query, params, row=Found)   # the rows as records, by name
    claimed = yield Statement(query, params, named=True)  # named tuples, as cheap
    ids = yield Statement(query, params, scalar=True)   # each row's one column

Enqueue and receive (``_enqueue``), the reading of the queue (``_queue``), the claimer,
the recorder, the completion hooks and the reconciler are all steps, so what they decide
exists once whether a blocking connection, an asyncio one or an ORM runs it. The
instruction is a ``Statement`` almost everywhere; a caller whose steps need more (the
dispatcher's hooks yield ``CallHook`` too) supplies an executor that understands it:
the drivers only pass instructions along, answers back and errors in.

An error the executor raises (any ``Exception``) is thrown into the step at its
``yield``: a step that does not catch it ends with that very error, unchanged, which the
driver lets propagate. Anything else (``KeyboardInterrupt``, a cancellation) is not
thrown in; it propagates from the driver at once.

The two drivers are the same dozen lines, one with ``await``: written once (an ``async
def`` loop that the blocking side drives without an event loop), the blocking driver
costs about twice as much a step (``python -m benchmarks.step_drivers``), on the
enqueue's path and every dispatcher statement's; so each flavour keeps its own.
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Awaitable, Callable, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, TypeVar

import psycopg
from psycopg.rows import BaseRowFactory, kwargs_row, namedtuple_row, scalar_row, tuple_row

__all__ = ["ColumnsChanged", "Rows", "Statement", "Step", "execute", "execute_async",
           "row_factory", "run", "run_async", "shaped"]

T = TypeVar("T")
I = TypeVar("I")  # noqa: E741  the instruction a step yields
A = TypeVar("A")  # the answer it is sent
Rows = list[Any]
"""What a statement answers: tuples, or the records its ``row`` makes."""


@dataclass(frozen=True, slots=True)
class Statement:
    """One statement to run (on a dispatcher connection: in its own transaction; in a
    business transaction: in that one). ``query`` is SQL text with ``%(name)s``
    parameters. With ``count``, the rows answered are ``[(rowcount,)]`` (for a DELETE
    that returns nothing). With ``row`` (a frozen dataclass, or any callable taking the
    columns as keyword arguments), each row is answered as ``row(**columns)``: a reader
    names the columns it reads instead of counting them. With ``scalar``, each row is
    answered as the value of its one column (``RETURNING j.id``), as cheaply as a tuple:
    the fenced writes of the recorder's hot path. With ``named``, each row is a named
    tuple (psycopg's ``namedtuple_row``: columns by name at nearly a tuple's cost). With
    ``columns``, each row is a plain tuple of exactly these columns, in this order: their
    names are checked against the statement's once per execution (``ColumnsChanged``
    otherwise), and no row object is made: the claim's hot path, which reads its
    thousands of rows by the places ``columns`` names. Without any, rows are tuples
    (the steps an ORM's cursor runs)."""

    query: str
    params: Mapping[str, Any]
    count: bool = False
    row: Callable[..., Any] | None = None
    scalar: bool = False
    named: bool = False
    columns: tuple[str, ...] | None = None


class ColumnsChanged(Exception):
    """A statement answered other columns than its ``Statement.columns`` name: the
    query and its reader disagree (a bug, never a database state)."""


def _check_columns(expected: tuple[str, ...], names: Sequence[str]) -> None:
    if tuple(names) != expected:
        raise ColumnsChanged(f"the statement answered the columns {list(names)}, its "
                             f"reader expects {list(expected)}")


def _columns_row(expected: tuple[str, ...]) -> BaseRowFactory[Any]:
    def factory(cursor: Any) -> Any:
        description = cursor.description
        if description is not None:
            _check_columns(expected, [column.name for column in description])
        return tuple  # the very type: psycopg's C rows take their fast path on it
    return factory


Step = Generator[Statement, Rows, T]
"""A step that asks only for statements: yields ``Statement``, is sent rows, returns T."""


def execute(conn: psycopg.Connection[Any], statement: Statement) -> Rows:
    """Run ``statement`` on ``conn`` (in its transaction, if one is open) and answer as a
    step expects: its rows, ``[(rowcount,)]`` with ``count``, ``[]`` for no result."""
    cursor = conn.cursor(row_factory=row_factory(statement))
    cursor.execute(statement.query, statement.params)
    if statement.count:
        return [(cursor.rowcount,)]
    return cursor.fetchall() if cursor.description else []


async def execute_async(conn: psycopg.AsyncConnection[Any], statement: Statement) -> Rows:
    """``execute`` on an asyncio connection."""
    cursor = conn.cursor(row_factory=row_factory(statement))
    await cursor.execute(statement.query, statement.params)
    if statement.count:
        return [(cursor.rowcount,)]
    return await cursor.fetchall() if cursor.description else []


def row_factory(statement: Statement) -> BaseRowFactory[Any]:
    """How ``statement``'s rows are made on a psycopg cursor: tuples unless it asks
    otherwise, whatever row factory the caller's connection has."""
    if statement.scalar:
        return scalar_row
    if statement.row is not None:
        return kwargs_row(statement.row)
    if statement.named:
        return namedtuple_row
    if statement.columns is not None:
        return _columns_row(statement.columns)
    return tuple_row


def shaped(statement: Statement, names: Sequence[str], rows: Iterable[Sequence[Any]]) -> Rows:
    """``rows`` (plain sequences of the columns ``names``) as ``statement`` asks for them:
    the shaping ``row_factory`` gives on a psycopg cursor, for an executor whose cursor
    is not one (an ORM's)."""
    if statement.scalar:
        return [value for value, in rows]
    if statement.row is not None:
        make = statement.row
        return [make(**dict(zip(names, row, strict=True))) for row in rows]
    if statement.named:
        record = _named_tuple(tuple(names))
        return [record._make(row) for row in rows]
    if statement.columns is not None:
        _check_columns(statement.columns, names)
    return [tuple(row) for row in rows]


@cache
def _named_tuple(names: tuple[str, ...]) -> Any:
    return namedtuple("Row", names)


def run(step: Generator[I, A, T], execute: Callable[[I], A],
        throws: type[BaseException] = Exception) -> T:
    """Drive ``step`` to its result with a blocking ``execute``. ``throws``: the errors
    of ``execute`` thrown into the step (``Exception``; the loops of
    ``outbox._dispatch.runtime`` take every ``BaseException``); anything else propagates
    from here at once."""
    try:
        instruction = next(step)
        while True:
            try:
                answer = execute(instruction)
            except throws as exc:
                instruction = step.throw(exc)
            else:
                instruction = step.send(answer)
    except StopIteration as done:
        result: T = done.value
        return result


async def run_async(step: Generator[I, A, T], execute: Callable[[I], Awaitable[A]],
                    throws: type[BaseException] = Exception) -> T:
    """Drive ``step`` to its result with an asyncio ``execute``: ``run``'s twin."""
    try:
        instruction = next(step)
        while True:
            try:
                answer = await execute(instruction)
            except throws as exc:
                instruction = step.throw(exc)
            else:
                instruction = step.send(answer)
    except StopIteration as done:
        result: T = done.value
        return result
