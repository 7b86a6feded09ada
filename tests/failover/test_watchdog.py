"""The watchdog asks the server of a statement that waits: a slow statement on a live
server (here a claim waiting for a lock someone holds) gets an answer to the probe and
is left alone, neither cut nor said; only a server that does not answer is
(``test_frozen``, ``test_partition``)."""

from __future__ import annotations

import logging
import threading

import psycopg
import pytest

import outbox
from outbox import Dispatcher

from .support import Orders, ours, threads_now, wait_until

HELD_FOR = 6.0  # seconds the queue is locked: past the watchdog's question and answer


def test_a_claim_waiting_for_a_lock_on_a_live_server_is_left_alone(
        dsn: str, schema: str, caplog: pytest.LogCaptureFixture) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction(), \
            outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue("order.charge", key="slow", payload={})
    orders = Orders()
    dispatcher = Dispatcher(dsn, effects=[orders.effect()], schema=schema,
                            poll_interval=0.1)
    runner = threading.Thread(target=dispatcher.run)
    earlier = threads_now()
    with caplog.at_level(logging.INFO, logger="outbox"), \
            psycopg.connect(dsn, autocommit=True) as locker:
        with locker.transaction():
            locker.execute(f"LOCK TABLE {schema}.jobs IN ACCESS EXCLUSIVE MODE")
            runner.start()
            try:
                # The claim waits for the lock while the watchdog asks the server.
                waiting = threading.Event()
                waiting.wait(HELD_FOR)
                assert orders.seen() == set()
            except BaseException:
                dispatcher.stop()
                raise
        try:
            wait_until(lambda: orders.seen() == {"slow"}, 30, "the effect after the lock")
        finally:
            dispatcher.stop()
            runner.join(60)
    said = [r.getMessage() for r in ours(caplog.records, earlier)]
    assert not [line for line in said if "has not answered" in line], said
    assert not [line for line in said if "lost its connection" in line], said
