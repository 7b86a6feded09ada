"""A connection string that reaches a standby: one clear line, backoff, no storm; an
enqueue there raises ``ReadOnlyDatabase``; promoted, the same dispatcher dispatches."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import psycopg
import pytest

import outbox
from outbox import AsyncDispatcher, Dispatcher, ReadOnlyDatabase

from .support import Orders, enqueue_orders, ours, pair, prepare, threads_now, wait_until

WINDOW = 10.0  # seconds over which the log lines are counted


def test_a_standby_is_said_once_then_served_once_promoted(
        caplog: pytest.LogCaptureFixture) -> None:
    with pair() as servers:
        prepare(servers.primary)
        servers.wait_replayed()
        standby = servers.standby
        orders = Orders()
        dispatcher = Dispatcher(standby.dsn, effects=[orders.effect()], poll_interval=0.2)
        runner = threading.Thread(target=dispatcher.run)
        sessions = "SELECT sessions FROM pg_stat_database WHERE datname = 'postgres'"
        earlier = threads_now()
        with caplog.at_level(logging.INFO, logger="outbox"):
            before = standby.execute(sessions)[0][0]
            runner.start()
            try:
                # An observation window, not a synchronisation: what the dispatcher says
                # about the standby over 10 s, and how often it connects.
                time.sleep(WINDOW)
                said = [r for r in ours(caplog.records, earlier)
                        if r.levelno >= logging.WARNING]
                opened = standby.execute(sessions)[0][0] - before - 1
                servers.primary.kill9()
                standby.promote()
                enqueue_orders(standby.dsn, ["after-promotion"])
                wait_until(lambda: orders.seen() == {"after-promotion"}, 30,
                           "the job enqueued on the promoted standby")
            finally:
                dispatcher.stop()
                runner.join(30)
        assert not runner.is_alive()
        lines = [r.getMessage() for r in said]
        assert len(lines) == 1, lines
        [line] = lines
        where = f"host 127.0.0.1 port {standby.port}"
        assert f"the database at {where} is a standby (in recovery" in line, line
        assert "target_session_attrs=read-write" in line, line
        # The backoff: a few sessions in the window (three parts reconnecting), not a
        # storm of them.
        assert 3 <= opened <= 25, opened
        assert any("takes writes again" in r.getMessage() for r in caplog.records)


def test_enqueue_on_a_standby_raises_read_only_database() -> None:
    with pair() as servers:
        prepare(servers.primary)
        servers.wait_replayed()
        with psycopg.connect(servers.standby.dsn) as conn, pytest.raises(
                ReadOnlyDatabase, match=r"read-only \(a standby") as raised, \
                outbox.transaction(conn) as tx:
            tx.enqueue("order.charge", key="k-1", payload={})
        assert isinstance(raised.value.__cause__, psycopg.errors.ReadOnlySqlTransaction)
        assert "cannot execute" not in str(raised.value)  # not PostgreSQL's text

        async def enqueue_async() -> None:
            async with await psycopg.AsyncConnection.connect(servers.standby.dsn) as aconn, \
                    outbox.transaction(aconn) as atx:
                await atx.enqueue("order.charge", key="k-2", payload={})

        with pytest.raises(ReadOnlyDatabase):
            asyncio.run(enqueue_async())
        # AsyncDispatcher: the standby refused as its connections open, its
        # run_until_idle gives up at its timeout saying so.
        dispatcher = AsyncDispatcher(servers.standby.dsn, effects=[Orders().effect()])
        with pytest.raises(psycopg.OperationalError, match="takes no writes"):
            asyncio.run(dispatcher.run_until_idle(timeout=2))
