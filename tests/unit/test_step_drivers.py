"""The two drivers of ``outbox._steps``, each test run with both: the blocking ``run`` and
the asyncio ``run_async`` must answer, throw in and pass on exactly alike."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from typing import Any

import psycopg
import pytest

import outbox
from outbox._dispatch.hooked import CallHook, HookLeftAborted, HookRaised, HookStep, call_hook
from outbox._steps import Rows, Statement, Step, run, run_async
from outbox.sql import queries

FIRST = Statement("SELECT 1", {"n": 1})
SECOND = Statement("SELECT 2", {"n": 2})
FALLBACK = Statement("SELECT 'fallback'", {})


class Script:
    """Answers each instruction with the next scripted answer (or raises it), and
    records what was asked."""

    def __init__(self, *answers: Any) -> None:
        self.answers = list(answers)
        self.asked: list[Any] = []

    def __call__(self, instruction: Any) -> Any:
        self.asked.append(instruction)
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer


Drive = Callable[[Generator[Any, Any, Any], Script], Any]


def drive_blocking(step: Generator[Any, Any, Any], script: Script) -> Any:
    return run(step, script)


def drive_async(step: Generator[Any, Any, Any], script: Script) -> Any:
    async def execute(instruction: Any) -> Any:
        await asyncio.sleep(0)  # a real suspension, as a connection's would be
        return script(instruction)

    return asyncio.run(run_async(step, execute))


@pytest.fixture(params=[drive_blocking, drive_async], ids=["run", "run_async"])
def drive(request: pytest.FixtureRequest) -> Drive:
    return request.param  # type: ignore[no-any-return]


def two_statements() -> Step[tuple[Rows, Rows]]:
    first = yield FIRST
    second = yield SECOND
    return first, second


def test_answers_are_sent_back_in_order_and_the_result_returned(drive: Drive) -> None:
    script = Script([(1,)], [(2,), (3,)])
    assert drive(two_statements(), script) == ([(1,)], [(2,), (3,)])
    assert script.asked == [FIRST, SECOND]


def test_a_step_that_asks_nothing_returns_at_once(drive: Drive) -> None:
    def nothing() -> Step[str]:
        return "done"
        yield FIRST  # a step, though it never asks

    script = Script()
    assert drive(nothing(), script) == "done" and script.asked == []


def test_an_error_thrown_in_and_caught_lets_the_step_go_on(drive: Drive) -> None:
    refused = psycopg.errors.CheckViolation("refused")

    def tolerant() -> Step[tuple[str, Rows]]:
        try:
            yield FIRST
        except psycopg.errors.CheckViolation as exc:
            rows = yield FALLBACK  # the step decides what comes next
            return str(exc), rows
        raise AssertionError("the error was not thrown in")

    script = Script(refused, [("fallback",)])
    assert drive(tolerant(), script) == ("refused", [("fallback",)])
    assert script.asked == [FIRST, FALLBACK]


def test_an_error_the_step_does_not_catch_reaches_the_caller_unchanged(drive: Drive) -> None:
    refused = psycopg.errors.UniqueViolation("duplicate")
    seen: list[BaseException] = []

    def careless() -> Step[None]:
        try:
            yield FIRST
            yield SECOND
        except BaseException as exc:
            seen.append(exc)  # at the yield that asked: the error was thrown in here
            raise

    script = Script(refused)
    with pytest.raises(psycopg.errors.UniqueViolation) as raised:
        drive(careless(), script)
    assert raised.value is refused and seen == [refused]
    assert script.asked == [FIRST]  # nothing asked after the error


def test_an_error_of_the_step_itself_propagates(drive: Drive) -> None:
    def buggy() -> Step[None]:
        yield FIRST
        raise KeyError("a bug")

    with pytest.raises(KeyError, match="a bug"):
        drive(buggy(), Script([]))


def test_what_is_not_an_exception_is_not_thrown_in(drive: Drive) -> None:
    thrown_in: list[BaseException] = []

    def step() -> Step[None]:
        try:
            yield FIRST
        except KeyboardInterrupt as exc:  # pragma: no cover - must not happen
            thrown_in.append(exc)
            raise

    with pytest.raises(KeyboardInterrupt):
        drive(step(), Script(KeyboardInterrupt()))
    assert thrown_in == []


def test_the_enqueue_step_gives_back_a_statement_error_unchanged(drive: Drive) -> None:
    """Enqueue steps never caught errors: thrown in, they come out as they went in."""
    from outbox._enqueue import enqueue_steps, prepare

    refused = psycopg.errors.UndefinedTable('relation "outbox.jobs" does not exist')
    step = enqueue_steps(prepare("email.send", "k1", {"to": "a"}), queries("outbox"))
    with pytest.raises(psycopg.errors.UndefinedTable) as raised:
        drive(step, Script(refused))
    assert raised.value is refused


# -- the hook instruction ------------------------------------------------------------------

JOB = outbox.Job(id=7, effect="test.hooked", key="k7", payload={}, attempt=1,
                 claim_version=3, ordering_key=None, max_attempts=5, first_attempted_at=None)
QUERIES = type("Queries", (), {"adopt_followups": "adopt"})()


def hook(tx: Any, job: outbox.Job, value: Any) -> None:
    """Never called here: the scripted executor stands for the transaction."""


def calling_the_hook() -> HookStep[Exception | None]:
    return call_hook(hook, JOB, {"id": "ch_1"}, QUERIES)


def test_the_hook_instruction_goes_to_the_executor_and_follow_ups_are_adopted(
        drive: Drive) -> None:
    script = Script([41, 42], [], [(1,)])  # the ids the hook created, adopt, SELECT 1
    assert drive(calling_the_hook(), script) is None
    call, adopt, check = script.asked
    assert isinstance(call, CallHook) and (call.fn, call.job, call.value) == (
        hook, JOB, {"id": "ch_1"})
    assert adopt == Statement("adopt", {"parent": "k7", "ids": [41, 42]})
    assert check.query == "SELECT 1"


def test_a_hook_that_raised_is_answered_with_its_error(drive: Drive) -> None:
    broke = ValueError("the hook broke")
    script = Script(HookRaised(broke))
    assert drive(calling_the_hook(), script) is broke
    assert len(script.asked) == 1  # nothing adopted, nothing checked


def test_a_hook_that_left_its_transaction_aborted_is_a_failed_hook(drive: Drive) -> None:
    script = Script([], psycopg.errors.InFailedSqlTransaction("aborted"))
    error = drive(calling_the_hook(), script)
    assert isinstance(error, HookLeftAborted) and "InFailedSqlTransaction" in str(error)


def test_a_lost_connection_during_a_hook_is_not_blamed_on_the_hook(drive: Drive) -> None:
    gone = psycopg.OperationalError("server closed the connection")
    with pytest.raises(psycopg.OperationalError) as raised:
        drive(calling_the_hook(), Script([], gone))
    assert raised.value is gone
