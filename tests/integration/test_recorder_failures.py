"""The recorder retries database errors only: a bug in it (here, in the heartbeat) ends
the run loudly with ``DispatcherFailed`` instead of repeating every round while the
leases it should extend expire."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import outbox
from outbox._dispatch.recorder import Recorder
from outbox._steps import Step

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
