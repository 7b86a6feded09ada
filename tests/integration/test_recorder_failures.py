"""The recorder retries database errors only: a bug in it (here, in the heartbeat, and in
the writing of hooked outcomes) ends the run loudly with ``DispatcherFailed`` instead of
repeating every round while the leases it should extend expire."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import outbox
from outbox._dispatch.hooked import HookedOutcomes
from outbox._dispatch.recorder import Recorder
from outbox._steps import Step
from outbox.observe import AttemptOutcome, DispatchObserver

RAISED = threading.Event()


class WaitsForTheHeartbeat(outbox.Effect):
    """Runs until the heartbeat has failed, so a heartbeat is due while it runs."""

    name = "test.waits"

    def perform(self, job: outbox.Job) -> None:
        assert RAISED.wait(30), "the heartbeat never ran"


@pytest.fixture
def broken_heartbeat(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    calls: list[int] = []

    def heartbeat(self: Recorder) -> Step[None]:
        calls.append(1)
        RAISED.set()
        raise RuntimeError("a bug in the heartbeat")
        yield  # a step, like the real one

    RAISED.clear()
    monkeypatch.setattr(Recorder, "heartbeat", heartbeat)
    yield calls


@pytest.mark.parametrize("flavour", ["threads", "async"])
def test_an_unexpected_heartbeat_error_stops_the_dispatcher(
        dsn: str, schema: str, flavour: str, broken_heartbeat: list[int]) -> None:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue("test.waits", key="w1", payload={})
    options: dict[str, Any] = {"schema": schema, "lease": 1.0}
    with pytest.raises(outbox.DispatcherFailed) as failed:
        if flavour == "threads":
            outbox.Dispatcher(dsn, [WaitsForTheHeartbeat()], **options).run_until_idle(
                timeout=60)
        else:
            asyncio.run(outbox.AsyncDispatcher(dsn, [WaitsForTheHeartbeat()], **options)
                        .run_until_idle(timeout=60))
    assert isinstance(failed.value.__cause__, RuntimeError)
    assert broken_heartbeat == [1]  # not repeated round after round


class Hooked(outbox.Effect):
    """Done at once, with a completion hook (sync, or ``async def`` on AsyncDispatcher)."""

    name = "test.hooked"

    def perform(self, job: outbox.Job) -> None:
        return None

    def on_done(self, tx: outbox.HookTransaction, job: outbox.Job, result: Any) -> None:
        raise AssertionError("never called: the hooked write fails before")


class AsyncHooked(Hooked):
    async def on_done(self, tx: outbox.AsyncHookTransaction,  # type: ignore[override]
                      job: outbox.Job, result: Any) -> None:
        raise AssertionError("never called: the hooked write fails before")


class Finished(DispatchObserver):
    def __init__(self) -> None:
        self.outcomes: list[str] = []

    def attempt_finished(self, effect: str, outcome: AttemptOutcome,
                         duration: float) -> None:
        self.outcomes.append(outcome)


@pytest.mark.parametrize("flavour", ["threads", "async", "async-plain"])
def test_an_unexpected_error_writing_hooked_outcomes_stops_the_dispatcher(
        dsn: str, schema: str, flavour: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def fast(self: HookedOutcomes, items: list[Any]) -> Any:
        calls.append(1)
        raise RuntimeError("a bug in the hooked write")
        yield  # a step, like the real one

    monkeypatch.setattr(HookedOutcomes, "fast", fast)
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue("test.hooked", key="h1", payload={})
    observer = Finished()
    options: dict[str, Any] = {"schema": schema, "observer": observer}
    with pytest.raises(outbox.DispatcherFailed) as failed:
        if flavour == "threads":
            outbox.Dispatcher(dsn, [Hooked()], **options).run_until_idle(timeout=60)
        else:
            effect = AsyncHooked() if flavour == "async" else Hooked()
            asyncio.run(outbox.AsyncDispatcher(dsn, [effect], **options)
                        .run_until_idle(timeout=60))
    assert isinstance(failed.value.__cause__, RuntimeError)
    assert calls == [1]  # not retried one by one as if the database had refused it
    assert observer.outcomes == ["lost"]  # the attempt still reached the observer
