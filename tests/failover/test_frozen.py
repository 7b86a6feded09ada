"""A primary that freezes (every server process stopped: the machine still answers TCP,
so no keepalive fails) while a dispatcher runs: a stop returns within ``stop_timeout``
+ 2 s all the same, its blocked connections cut, and says so; ``Dispatcher`` and
``AsyncDispatcher`` alike."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable

import psutil
import pytest

from outbox import AsyncDispatcher, Dispatcher

from .support import Orders, enqueue_orders, pair, prepare, wait_until

STOP_TIMEOUT = 3.0


def _stacks() -> str:
    """Where every thread of this process is (what a stop still waits for)."""
    return "\n".join(f"{thread}:\n{''.join(traceback.format_stack(frame))}"
                     for thread, frame in sys._current_frames().items())


def _runner(dispatcher: Dispatcher | AsyncDispatcher) -> Callable[[], object]:
    if isinstance(dispatcher, AsyncDispatcher):
        return lambda: asyncio.run(dispatcher.run())
    return dispatcher.run
FROZEN_FOR = 1.0  # seconds of freeze before the stop: the claimer's next claim blocks


@pytest.mark.parametrize("flavour", ["Dispatcher", "AsyncDispatcher"])
def test_a_stop_returns_while_the_primary_is_frozen(
        flavour: str, caplog: pytest.LogCaptureFixture) -> None:
    with pair() as servers:
        primary = servers.primary
        prepare(primary)
        enqueue_orders(primary.dsn, ["before"])
        orders = Orders()
        kind = Dispatcher if flavour == "Dispatcher" else AsyncDispatcher
        dispatcher = kind(primary.dsn, effects=[orders.effect()], poll_interval=0.1,
                          stop_timeout=STOP_TIMEOUT)
        runner = threading.Thread(target=_runner(dispatcher))
        processes: list[psutil.Process] = []
        with caplog.at_level(logging.WARNING, logger="outbox"):
            runner.start()
            try:
                wait_until(lambda: orders.seen() == {"before"}, 30, "the first effect")
                processes = primary.processes()  # with the dispatcher's backends
                for process in processes:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        process.send_signal(signal.SIGSTOP)
                frozen_at = time.monotonic()
                wait_until(lambda: time.monotonic() - frozen_at >= FROZEN_FOR, 10,
                           "the freeze to last")
                stopped_at = time.monotonic()
                dispatcher.stop()
                runner.join(STOP_TIMEOUT + 2)
                returned = time.monotonic() - stopped_at
                stacks = _stacks() if runner.is_alive() else ""
            finally:
                for process in processes:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        process.send_signal(signal.SIGCONT)
                dispatcher.stop()
                runner.join(60)
        assert returned < STOP_TIMEOUT + 2, f"{returned} s; still running:\n{stacks}"
        said = [r.getMessage() for r in caplog.records]
        assert any("still waits for the database" in line and "cut" in line
                   for line in said), said
