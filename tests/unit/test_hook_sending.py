"""How a chunk's hooks' statements reach the server (``outbox._dispatch.hooked``): held
in psycopg's pipeline queue and sent ``SENT_TOGETHER`` at a time or when an answer is
waited for; on a psycopg whose pipeline lacks what that relies on, left as psycopg sends
them. And the garbage collector paused for the hooks, restored whatever happens."""

from __future__ import annotations

import gc
import threading
from collections import deque
from collections.abc import Generator
from typing import Any

import pytest

from outbox._dispatch.collector import collection_paused
from outbox._dispatch.hooked import SENT_TOGETHER, _sent_together


class FakePipeline:
    """psycopg's pipeline as ``_sent_together`` sees it: a queue of commands to send,
    and the two generators that send them and fetch the answers (counted here)."""

    def __init__(self) -> None:
        self.command_queue: deque[Any] = deque()
        self.sent: list[int] = []
        self.communicated = 0
        self.fetched: list[bool] = []

    def _communicate_gen(self) -> Generator[Any, Any, None]:
        self.communicated += 1
        return
        yield

    def _fetch_gen(self, *, flush: bool) -> Generator[Any, Any, None]:
        self.fetched.append(flush)
        return
        yield

    def execute(self, n: int) -> None:
        """What psycopg's execute does in a pipeline: queue, then communicate."""
        self.command_queue.append(lambda: self.sent.append(n))
        for _ in self._communicate_gen():
            pass


def test_statements_are_sent_together_and_before_any_answer_is_awaited() -> None:
    pipeline = FakePipeline()
    _sent_together(pipeline)
    for n in range(SENT_TOGETHER - 1):
        pipeline.execute(n)
    assert pipeline.sent == [] and pipeline.communicated == 0  # held back
    pipeline.execute(SENT_TOGETHER - 1)
    assert pipeline.sent == list(range(SENT_TOGETHER))  # all at once, in order
    assert pipeline.communicated == 1
    pipeline.execute(100)
    for _ in pipeline._fetch_gen(flush=True):  # a cursor waits for its rows
        pass
    assert pipeline.sent[-1] == 100 and pipeline.fetched == [True]  # sent, then fetched


def test_a_pipeline_without_the_parts_relied_on_is_left_alone() -> None:
    class Other:
        def _communicate_gen(self) -> None: ...

    other = Other()
    original = other._communicate_gen
    _sent_together(other)  # no command_queue, no _fetch_gen: nothing changed
    assert other._communicate_gen == original
    assert not hasattr(other, "_fetch_gen")


def test_the_collector_is_paused_and_back_after_a_raise_and_left_off_if_off() -> None:
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collection_paused():
        assert not gc.isenabled()
        raise RuntimeError("a hook's bug")
    assert gc.isenabled()
    gc.disable()
    try:
        with collection_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_overlapping_pauses_of_two_recorders_keep_the_collector_off_until_the_last_ends() -> None:
    """Two recorders of one process: the first to end must not turn the collector back
    on under the other's chunk; the last to end does."""
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, bool] = {}

    def first() -> None:
        with collection_paused():
            first_in.set()
            second_in.wait(30)
        first_out.set()

    def second() -> None:
        first_in.wait(30)
        with collection_paused():
            second_in.set()
            first_out.wait(30)
            seen["after the first ended"] = gc.isenabled()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert seen == {"after the first ended": False}
    assert gc.isenabled()
