"""The loops' two drivers (``outbox._dispatch.runtime``): one program, carried out alike
by the blocking driver and the asyncio one; errors and cancellations thrown into the
program, whose ``finally`` still runs instructions; a shielded step not cut off."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Generator
from types import SimpleNamespace
from typing import Any, cast

import psycopg
import pytest

from outbox._dispatch.claimer import schema_wait
from outbox._dispatch.connection import Connection
from outbox._dispatch.runtime import (
    Blocking,
    Call,
    Cut,
    Flavoured,
    Program,
    Run,
    Sleep,
    Wait,
    drive,
    drive_async,
)
from outbox._dispatch.settings import Settings
from outbox._dispatch.signals import LoopEvent


class NoStatements:
    """Where a step's statements would run: these steps yield none."""

    def execute(self, statement: object) -> Any:
        raise AssertionError(f"no statement expected: {statement!r}")


def both(make: Callable[[Any], Program[Any]]) -> tuple[Any, Any]:
    """``make(event)``'s result under each driver (each with its flavour's event)."""
    blocking = drive(make(threading.Event()))

    async def main() -> Any:
        return await drive_async(make(LoopEvent()))

    return blocking, asyncio.run(main())


async def doubled_async(value: int) -> int:
    await asyncio.sleep(0)
    return value * 2


def test_one_program_answers_the_same_under_both_drivers() -> None:
    def program(event: Any) -> Program[list[Any]]:
        seen: list[Any] = []
        seen.append((yield Blocking(lambda a, b: a + b, 1, 2)))
        seen.append((yield Call(lambda: "called")))
        seen.append((yield Flavoured(lambda v: v * 2, doubled_async, 21)))
        yield Sleep(0)
        seen.append((yield Wait(event, 0.01)))  # not set: times out
        event.set()
        seen.append((yield Wait(event, 5.0)))  # set: answers at once
        seen.append(event.is_set())
        return seen

    blocking, in_asyncio = both(program)
    assert blocking == in_asyncio == [3, "called", 42, False, True, True]


def test_a_blocking_call_runs_on_another_thread_under_asyncio_only() -> None:
    def program(_: Any) -> Program[bool]:
        here = threading.get_ident()
        there = yield Blocking(threading.get_ident)
        return bool(there == here)

    assert both(program) == (True, False)


def test_a_call_awaits_what_it_returns_under_asyncio() -> None:
    def program(_: Any) -> Program[Any]:
        return (yield Call(lambda: asyncio.sleep(0, "awaited")))

    async def main() -> Any:
        return await drive_async(program(None))

    assert asyncio.run(main()) == "awaited"


def test_an_error_is_thrown_into_the_program_where_it_yielded() -> None:
    def boom() -> None:
        raise ValueError("refused")

    def program(_: Any) -> Program[str]:
        try:
            yield Blocking(boom)
        except ValueError as exc:
            return f"handled {exc}"
        return "not raised"

    assert both(program) == ("handled refused", "handled refused")


def test_an_error_not_handled_propagates_unchanged_after_the_finally_ran() -> None:
    raised = ValueError("refused")
    ran: list[str] = []

    def boom() -> None:
        raise raised

    def program(_: Any) -> Program[None]:
        try:
            yield Blocking(boom)
        finally:
            ran.append((yield Call(lambda: "goodbye")))

    with pytest.raises(ValueError) as blocking:
        drive(program(None))
    assert blocking.value is raised

    async def main() -> None:
        await drive_async(program(None))

    with pytest.raises(ValueError) as in_asyncio:
        asyncio.run(main())
    assert in_asyncio.value is raised
    assert ran == ["goodbye", "goodbye"]


def test_a_keyboard_interrupt_still_lets_the_finally_run_its_instructions() -> None:
    ran: list[str] = []

    def interrupt() -> None:
        raise KeyboardInterrupt

    def program() -> Program[None]:
        try:
            yield Blocking(interrupt)
        finally:
            ran.append((yield Call(lambda: "said goodbye")))

    with pytest.raises(KeyboardInterrupt):
        drive(program())
    assert ran == ["said goodbye"]


def test_a_cancellation_is_thrown_in_and_the_finally_still_awaits() -> None:
    ran: list[str] = []

    def program(event: LoopEvent) -> Program[None]:
        try:
            yield Wait(event, 60.0)
        finally:
            ran.append((yield Flavoured(lambda: "blocking", lambda: doubled_async(4))))
            ran.append((yield Blocking(lambda: "on a thread")))

    async def main() -> None:
        started = asyncio.Event()

        async def run_it() -> None:
            started.set()
            await drive_async(program(LoopEvent()))

        task = asyncio.ensure_future(run_it())
        await started.wait()
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert ran == [8, "on a thread"]


Finish = object()


def slow_step() -> Generator[object, Any, str]:
    """A step that asks for one instruction besides statements (translated to a call
    that waits until it is let go): the shape of a claim between commit and reply."""
    yield Finish
    return "claimed"


def test_a_shielded_step_is_not_cut_off_by_a_cancellation() -> None:
    handled: list[Any] = []

    async def main() -> None:
        entered, let_go = asyncio.Event(), asyncio.Event()

        async def committing() -> None:
            entered.set()
            await let_go.wait()

        def translate(instruction: object) -> Call:
            assert instruction is Finish
            return Call(committing)

        def program() -> Program[None]:
            try:
                yield Run(slow_step(), NoStatements(), translate, shielded=True)
            except Cut as cut:
                handled.append("cut")
                handled.append((yield cut.rest))  # the step's own result, once it ends
                raise cut.error from None

        task = asyncio.ensure_future(drive_async(program()))
        await entered.wait()
        task.cancel()
        await asyncio.sleep(0.01)
        assert not task.done()  # waits for the step, which the cancel did not cut
        let_go.set()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert handled == ["cut", "claimed"]


def test_an_unshielded_step_is_cut_off() -> None:
    ended: list[str] = []

    async def main() -> None:
        entered = asyncio.Event()

        async def forever() -> None:
            entered.set()
            await asyncio.Event().wait()

        def program() -> Program[None]:
            try:
                yield Run(slow_step(), NoStatements(), lambda _: Call(forever))
            except Cut:
                ended.append("cut")
                raise
            except asyncio.CancelledError:
                ended.append("cancelled")
                raise

        task = asyncio.ensure_future(drive_async(program()))
        await entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert ended == ["cancelled"]


def test_a_step_gets_only_exceptions_thrown_in() -> None:
    """As ``outbox._steps.run``: a step is not thrown a ``KeyboardInterrupt`` (the
    program around it is)."""
    in_step: list[str] = []

    def step() -> Generator[object, Any, None]:
        try:
            yield Finish
        except GeneratorExit:  # closed once dropped: not a throw
            raise
        except BaseException:
            in_step.append("thrown in")
            raise

    def interrupt() -> None:
        raise KeyboardInterrupt

    def program() -> Program[str]:
        try:
            yield Run(step(), NoStatements(), lambda _: Blocking(interrupt))
        except KeyboardInterrupt:
            return "the program saw it"
        return "not raised"

    assert drive(program()) == "the program saw it"
    assert in_step == []


def test_what_is_not_an_instruction_is_refused_by_name() -> None:
    def program() -> Program[None]:
        yield "SELECT 1"

    with pytest.raises(TypeError,
                       match="not a loop instruction for the blocking driver: 'SELECT 1'"):
        drive(program())

    async def main() -> None:
        await drive_async(program())

    with pytest.raises(TypeError, match="not a loop instruction for the asyncio driver"):
        asyncio.run(main())


# -- a program of the dispatcher's, under both drivers: the schema wait's policy -------


def unreachable() -> None:
    raise psycopg.OperationalError("connection refused")


def never_opened(role: str) -> Any:
    raise AssertionError(f"no {role} connection expected")


def test_the_schema_wait_gives_up_at_its_deadline_under_both_drivers() -> None:
    settings = cast(Settings, SimpleNamespace(conninfo="host=nowhere"))
    attempts: list[str] = []

    def check() -> None:
        attempts.append("checked")
        unreachable()

    def program(event: Any) -> Program[None]:
        state = SimpleNamespace(stopping=event)
        conn = Connection(never_opened, "claimer")
        return schema_wait(conn, check, settings, cast(Any, state), time.monotonic() + 0.5)

    with pytest.raises(psycopg.OperationalError):
        drive(program(threading.Event()))
    blocking = len(attempts)

    async def main() -> None:
        await drive_async(program(LoopEvent()))

    with pytest.raises(psycopg.OperationalError):
        asyncio.run(main())
    assert blocking >= 2  # it waited and tried again before giving up
    assert len(attempts) - blocking >= 2


def test_the_schema_wait_ends_at_a_stop_under_both_drivers() -> None:
    settings = cast(Settings, SimpleNamespace(conninfo="host=nowhere"))

    def program(event: Any) -> Program[None]:
        event.set()  # the stop came: the first backoff ends it
        state = SimpleNamespace(stopping=event)
        return schema_wait(Connection(never_opened, "claimer"), unreachable, settings,
                           cast(Any, state), None)

    assert drive(program(threading.Event())) is None

    async def main() -> None:
        await drive_async(program(LoopEvent()))

    asyncio.run(main())
