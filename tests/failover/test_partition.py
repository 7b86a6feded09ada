"""A primary cut off the network (every packet dropped: the server runs in a network
namespace of its own whose link is set down; ``ip netns`` works here as root): the
dispatcher notices within 10 s and says so naming the host (the watchdog's probe gets no
answer, or the connections' keepalives and tcp_user_timeout end them at 8 s, whichever
comes first; not the kernel's 15 minutes of retransmissions), and a stop during the
partition returns within ``stop_timeout`` + 2 s; ``Dispatcher`` and ``AsyncDispatcher``
alike."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from outbox import AsyncDispatcher, Dispatcher

from .support import Orders, enqueue_orders, partitionable, prepare, wait_until

NOTICED_WITHIN = 10.0
STOP_TIMEOUT = 10.0


@pytest.mark.parametrize("flavour", ["Dispatcher", "AsyncDispatcher"])
def test_a_partitioned_primary_is_noticed_and_a_stop_returns(
        flavour: str, caplog: pytest.LogCaptureFixture) -> None:
    with partitionable() as server:
        prepare(server)
        enqueue_orders(server.dsn, ["before"])
        orders = Orders()
        kind = Dispatcher if flavour == "Dispatcher" else AsyncDispatcher
        dispatcher = kind(server.dsn, effects=[orders.effect()], poll_interval=0.2,
                          stop_timeout=STOP_TIMEOUT)
        runner = threading.Thread(target=(
            (lambda: asyncio.run(dispatcher.run())) if isinstance(dispatcher, AsyncDispatcher)
            else dispatcher.run))
        with caplog.at_level(logging.WARNING, logger="outbox"):
            runner.start()
            try:
                wait_until(lambda: orders.seen() == {"before"}, 30, "the first effect")
                cut_at = time.time()
                server.partition()
                # The case: a stop 3 s into the partition (a rollout, say).
                wait_until(lambda: time.time() - cut_at >= 3, 10, "3 s of partition")
                stopped_at = time.monotonic()
                dispatcher.stop()
                runner.join(STOP_TIMEOUT + 2)
                returned = time.monotonic() - stopped_at
            finally:
                dispatcher.stop()
                runner.join(60)
        assert returned < STOP_TIMEOUT + 2, returned
        # Whichever notices first says so within 10 s, naming the host: the watchdog
        # (its probe gets no answer: at most one line), or the connections' own
        # keepalives and tcp_user_timeout (a lost connection, at 8 s), which may end
        # the waiting statement before the probe has given up.
        said = [r for r in caplog.records if "has not answered for" in r.getMessage()]
        assert len(said) <= 1, [r.getMessage() for r in said]
        lost = [r for r in caplog.records if "lost its connection" in r.getMessage()]
        assert lost, [r.getMessage() for r in caplog.records]
        first = min([*said, *lost], key=lambda r: r.created)
        assert first.created - cut_at < NOTICED_WITHIN, first.created - cut_at
        assert all(f"host {server.address} port {server.port}" in r.getMessage()
                   for r in said), [r.getMessage() for r in said]
        # The claimer's line names the host (the recorder's may come first).
        assert any(f"host {server.address}" in r.getMessage() for r in lost), [
            r.getMessage() for r in lost]
