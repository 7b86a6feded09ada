"""A claim turns its rows into held jobs with Python's cyclic garbage collector paused
(``outbox._dispatch.collector``): thousands of jobs made at once would otherwise trigger
a collection every few hundred, each walking them again. The collector is back on after
every claim, and a collector the application turned off stays off."""

from __future__ import annotations

import asyncio
import gc
import sys
from collections.abc import Iterator
from types import FrameType
from typing import Any

import pytest

from outbox import AsyncDispatcher, Dispatcher, NewJob

from .test_dispatcher_parts import ByPayload, enqueue

JOBS = 3000  # one claim of them: some 20,000 container objects, 30 collections' worth


@pytest.fixture
def collections_in_helds() -> Iterator[list[int]]:
    """The collections that started while a claim's rows were being made into jobs
    (``Claimer._helds`` on the collecting thread's stack), by generation."""
    seen: list[int] = []

    def callback(phase: str, info: dict[str, Any]) -> None:
        if phase != "start":
            return
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_name == "_helds":
                seen.append(info["generation"])
                return
            frame = frame.f_back

    gc.callbacks.append(callback)
    try:
        yield seen
    finally:
        gc.callbacks.remove(callback)


def _backlog(dsn: str, schema: str, prefix: str) -> None:
    enqueue(dsn, schema, *[NewJob("test.by_payload", f"{prefix}{i}", {}) for i in range(JOBS)])


def test_no_collection_runs_while_a_claim_makes_its_jobs(
        dsn: str, schema: str, collections_in_helds: list[int]) -> None:
    _backlog(dsn, schema, "s")
    assert gc.isenabled()
    stats = Dispatcher(dsn, [ByPayload()], schema=schema, batch_size=JOBS,
                       concurrency=8, retention=0).run_until_idle(timeout=120)
    assert stats.done == JOBS
    assert collections_in_helds == []
    assert gc.isenabled()


def test_the_async_claim_pauses_the_collector_too(
        dsn: str, schema: str, collections_in_helds: list[int]) -> None:
    _backlog(dsn, schema, "a")
    stats = asyncio.run(AsyncDispatcher(dsn, [ByPayload()], schema=schema, batch_size=JOBS,
                                        concurrency=8, retention=0).run_until_idle(timeout=120))
    assert stats.done == JOBS
    assert collections_in_helds == []
    assert gc.isenabled()


def test_a_collector_the_application_turned_off_stays_off(dsn: str, schema: str) -> None:
    _backlog(dsn, schema, "o")
    gc.disable()
    try:
        stats = Dispatcher(dsn, [ByPayload()], schema=schema, batch_size=JOBS,
                           concurrency=8, retention=0).run_until_idle(timeout=120)
        assert stats.done == JOBS
        assert not gc.isenabled()
    finally:
        gc.enable()
