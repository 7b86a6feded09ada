"""The dispatcher's loops written once: each loop is a generator "program" that yields
instructions, and two small drivers run any program, ``drive`` on a thread and
``drive_async`` as an asyncio task (the habit of ``outbox._steps``, one level up).

A program decides everything a loop decides (what a failure does, when to back off,
when to stop, what a cancellation between a claim's commit and its reply does); the
drivers only carry out its instructions, each in their flavour::

    rows = yield Run(step, conn)          # drive a step on a connection: its result
    more = yield Transaction(step, conn)  # the same, in one transaction of it
    woken = yield Wait(event, seconds)    # wait for an event, at most ``seconds``: set?
    yield Sleep(seconds)                  # back off
    value = yield Blocking(fn, *args)     # a blocking call (asyncio: on a thread)
    value = yield Call(fn, *args)         # a call whose result is awaited if awaitable
    value = yield Flavoured(fn, afn, *args)  # fn(*args), or await afn(*args)

Whatever an instruction raises, ``BaseException`` included, is thrown into the program
at its ``yield``: its ``finally`` clauses may yield more instructions (a goodbye to the
database while a cancellation or ``KeyboardInterrupt`` propagates), which the driver
still carries out, then the error propagates from the driver unchanged.

A ``Run`` with ``shielded`` is not cut off by an asyncio cancellation: the step runs on
to its end in a task of its own, and the program is thrown ``Cut``, whose ``rest`` it may
yield to wait for the step's result before it re-raises ``Cut.error``. Under ``drive``
there is no cancellation, and ``Cut`` is never thrown.

Inside a ``Run``, the step's ``Statement`` instructions run on ``conn``; any other
instruction is handed to ``translate``, which answers the loop instruction that carries
it out (a call to the limits' home becomes a ``Blocking``, for instance). As in
``outbox._steps``, only an ``Exception`` is thrown into the step.

A program of ``AsyncDispatcher``'s may hand part of its work to the blocking driver on a
thread, ``yield Blocking(drive, program)``: its plain (sync) hooks are written so, by the
same program that writes its ``async def`` ones. A program may drive another in the
flavour it runs in, ``yield Flavoured(drive, drive_async, program)`` (the rescue's hooks).

A dispatcher's whole run is a program too (``serving.serve``): it hands each part's
program to its flavour, which starts it on a thread or as a task.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol, TypeVar

from .._steps import Statement, execute, execute_async, run, run_async

__all__ = ["Blocking", "Call", "Cut", "Flavoured", "Program", "Rest", "Run", "Sleep",
           "Transaction", "Wait", "drive", "drive_async"]

T = TypeVar("T")

Program = Generator[Any, Any, T]
"""A loop: yields the instructions of this module, is sent their answers, returns T."""


class Executes(Protocol):
    """A connection a step runs on (``connection.Connection`` or ``AsyncConnection``)."""

    def execute(self, statement: Statement, /) -> Any: ...


@dataclass(frozen=True, slots=True)
class Run:
    """Drive ``step`` on ``conn``; answers its result. ``translate``: what the step's
    instructions other than ``Statement`` become (a loop instruction); ``shielded``: an
    asyncio cancellation does not cut the step off (see ``Cut``)."""

    step: Generator[Any, Any, Any]
    conn: Executes
    translate: Callable[[Any], Any] | None = None
    shielded: bool = False


@dataclass(frozen=True, slots=True)
class Transaction:
    """Drive ``step`` in one transaction of ``conn``'s connection: committed when the
    step returns, rolled back when it raises. Answers its result. The step's
    instructions run on that connection with ``blocking(pg)`` or ``asyncio(pg)`` (each
    makes the flavour's executor; by default statements only, ``_steps.execute``)."""

    step: Generator[Any, Any, Any]
    conn: Any
    blocking: Callable[[Any], Callable[[Any], Any]] | None = None
    asyncio: Callable[[Any], Callable[[Any], Awaitable[Any]]] | None = None


@dataclass(frozen=True, slots=True)
class Wait:
    """Wait for ``event`` (a ``Signal``) at most ``seconds`` (None: without end, on a
    thread only); answers whether it is set."""

    event: Any
    seconds: float | None


@dataclass(frozen=True, slots=True)
class Sleep:
    """Back off for ``seconds``, woken by nothing."""

    seconds: float


class _Calling:
    """A call of ``fn(*args)``, as an instruction."""

    __slots__ = ("args", "fn")

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self.fn = fn
        self.args = args

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.fn!r}, *{self.args!r})"


class Blocking(_Calling):
    """A blocking call: on the driver's thread, or (asyncio) on a thread of its own."""


class Call(_Calling):
    """A call that does not block (a ``discard``); what it returns awaited if awaitable."""


class Flavoured(_Calling):
    """Work that is written in each flavour (a transaction with hooks): ``drive`` calls
    ``fn(*args)``, ``drive_async`` awaits ``asyncio(*args)``."""

    __slots__ = ("asyncio",)

    def __init__(self, fn: Callable[..., Any], asyncio: Callable[..., Awaitable[Any]],
                 *args: Any) -> None:
        super().__init__(fn, *args)
        self.asyncio = asyncio


@dataclass(frozen=True, slots=True)
class Rest:
    """What a cut-off shielded step still answers (its result, or its error), once it
    ends. Yielded only from a handler of ``Cut``."""

    task: Any = field(repr=False)


class Cut(BaseException):
    """Thrown into a program when an asyncio cancellation came during a shielded ``Run``:
    ``error`` is the cancellation (to re-raise once done), ``rest`` the instruction that
    waits for the step the cancellation did not cut off."""

    def __init__(self, error: BaseException, rest: Rest) -> None:
        super().__init__("cancelled during a shielded step")
        self.error = error
        self.rest = rest


# -- the blocking driver ----------------------------------------------------------------------


def drive(program: Program[T]) -> T:
    """Run ``program`` to its end on this thread; its result, or what it raised."""
    return run(program, _carry_out, BaseException)


def _carry_out(instruction: Any) -> Any:
    kind = type(instruction)
    if kind is Run:
        return run(instruction.step, _step_executor(instruction))
    if kind is Transaction:
        pg = instruction.conn.get()
        executor = instruction.blocking or _statements
        with pg.transaction():
            return run(instruction.step, executor(pg))
    if kind is Wait:
        return instruction.event.wait(instruction.seconds)
    if kind is Sleep:
        time.sleep(instruction.seconds)
        return None
    if kind is Blocking or kind is Call or kind is Flavoured:
        return instruction.fn(*instruction.args)
    raise TypeError(f"not a loop instruction for the blocking driver: {instruction!r}")


def _statements(pg: Any) -> Callable[[Any], Any]:
    return partial(execute, pg)


def _statements_async(pg: Any) -> Callable[[Any], Awaitable[Any]]:
    return partial(execute_async, pg)


def _step_executor(instruction: Run) -> Callable[[Any], Any]:
    execute = instruction.conn.execute
    translate = instruction.translate
    if translate is None:
        return execute

    def carry(step_instruction: Any) -> Any:
        if type(step_instruction) is Statement:
            return execute(step_instruction)
        return _carry_out(translate(step_instruction))

    return carry


# -- the asyncio driver -----------------------------------------------------------------------


async def drive_async(program: Program[T]) -> T:
    """Run ``program`` to its end as (part of) an asyncio task: ``drive`` in the other
    flavour; a cancellation is thrown into the program like any error."""
    return await run_async(program, _carry_out_async, BaseException)


async def _carry_out_async(instruction: Any) -> Any:
    try:
        carry = _ASYNC[type(instruction)]
    except KeyError:
        raise TypeError(
            f"not a loop instruction for the asyncio driver: {instruction!r}") from None
    return await carry(instruction)


async def _wait_async(instruction: Wait) -> bool:
    if instruction.seconds is None:
        raise TypeError("an asyncio Wait needs seconds")
    woken: bool = await instruction.event.wait(instruction.seconds)
    return woken


async def _sleep_async(instruction: Sleep) -> None:
    await asyncio.sleep(instruction.seconds)


async def _blocking_async(instruction: Blocking) -> Any:
    return await asyncio.to_thread(instruction.fn, *instruction.args)


async def _call_async(instruction: Call) -> Any:
    value = instruction.fn(*instruction.args)
    return await value if inspect.isawaitable(value) else value


async def _flavoured_async(instruction: Flavoured) -> Any:
    return await instruction.asyncio(*instruction.args)


async def _rest_async(instruction: Rest) -> Any:
    return await instruction.task


async def _run_async(instruction: Run) -> Any:
    stepping = run_async(instruction.step, _step_executor_async(instruction))
    if not instruction.shielded:
        return await stepping
    # A task of its own, shielded: a cancellation must not cut the step off (a claim
    # between its commit and its reply would leave jobs claimed that nobody holds).
    task = asyncio.ensure_future(stepping)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError as exc:
        raise Cut(exc, Rest(task)) from None


async def _transaction_async(instruction: Transaction) -> Any:
    pg = await instruction.conn.get()
    executor = instruction.asyncio or _statements_async
    async with pg.transaction():
        return await run_async(instruction.step, executor(pg))


def _step_executor_async(instruction: Run) -> Callable[[Any], Any]:
    execute = instruction.conn.execute
    translate = instruction.translate
    if translate is None:
        return execute

    async def carry(step_instruction: Any) -> Any:
        if type(step_instruction) is Statement:
            return await execute(step_instruction)
        return await _carry_out_async(translate(step_instruction))

    return carry


_ASYNC: dict[type, Callable[[Any], Awaitable[Any]]] = {
    Run: _run_async, Transaction: _transaction_async, Wait: _wait_async,
    Sleep: _sleep_async, Blocking: _blocking_async, Call: _call_async,
    Flavoured: _flavoured_async, Rest: _rest_async,
}
