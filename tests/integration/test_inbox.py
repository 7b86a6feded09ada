"""The inbox: ``tx.receive(consumer, message_id)`` on real PostgreSQL and real connections."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
import pytest

import outbox
from outbox import InvalidKey
from outbox.sql import queries

from .helpers import fetch, table, wait_until


def _inbox(dsn: str, schema: str) -> list[tuple[Any, ...]]:
    return fetch(dsn, psycopg.sql.SQL("SELECT consumer, message_id FROM {} ORDER BY 1, 2")
                 .format(table(schema, "inbox")))


def test_first_receive_is_true_and_a_repeat_is_false(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn) as conn:
        with outbox.transaction(conn, schema=schema) as tx:
            assert tx.receive("billing", "msg-1") is True
            assert tx.receive("billing", "msg-1") is False  # repeated in the same txn
        with outbox.transaction(conn, schema=schema) as tx:
            assert tx.receive("billing", "msg-1") is False
            assert tx.receive("shipping", "msg-1") is True  # consumers are independent
    assert _inbox(dsn, schema) == [("billing", "msg-1"), ("shipping", "msg-1")]


def test_a_rolled_back_receive_leaves_no_row(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn) as conn:
        with pytest.raises(RuntimeError), outbox.transaction(conn, schema=schema) as tx:
            assert tx.receive("billing", "msg-2")
            raise RuntimeError("handling failed")
        assert _inbox(dsn, schema) == []
        with outbox.transaction(conn, schema=schema) as tx:
            assert tx.receive("billing", "msg-2") is True  # redelivered: handled now


def test_receive_joins_the_callers_transaction(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute("SELECT 1")
        with outbox.transaction(conn, schema=schema) as tx:
            assert tx.receive("billing", "msg-3")
        assert _inbox(dsn, schema) == []  # the caller has not committed yet
        conn.rollback()
    assert _inbox(dsn, schema) == []


@pytest.mark.parametrize(("consumer", "message_id", "error"), [
    ("", "m", "consumer must not be empty"),
    ("billing", "", "message_id must not be empty"),
    ("billing", "x" * 256, "message_id is 256 characters long"),
    ("bill\ning", "m", "consumer 'bill\\ning' has a character that is not printable ASCII"),
    ("billing", 7, "message_id must be a string, got int"),
])
def test_bad_names_are_refused_before_anything_is_written(
    dsn: str, schema: str, consumer: Any, message_id: Any, error: str
) -> None:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        with pytest.raises(InvalidKey) as raised:
            tx.receive(consumer, message_id)
        assert error in str(raised.value)
    assert _inbox(dsn, schema) == []


def _waiting_on_a_lock(dsn: str, pid: int) -> bool:
    rows = fetch(dsn, "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,))
    return rows == [("Lock",)]


@pytest.mark.parametrize("first_commits", [True, False])
def test_a_concurrent_receive_waits_for_the_first_transaction(
    dsn: str, schema: str, first_commits: bool
) -> None:
    with psycopg.connect(dsn) as first, psycopg.connect(dsn) as second:
        tx = outbox.transaction(first, schema=schema)
        tx.__enter__()
        assert tx.receive("billing", "msg-4") is True
        with ThreadPoolExecutor(1) as pool:
            def receive_on_second() -> bool:
                with outbox.transaction(second, schema=schema) as tx2:
                    return tx2.receive("billing", "msg-4")
            later = pool.submit(receive_on_second)
            wait_until(lambda: _waiting_on_a_lock(dsn, second.info.backend_pid),
                       what="the second receive to wait on the first's row")
            if first_commits:
                tx.__exit__(None, None, None)
            else:
                error = RuntimeError("handling failed")
                tx.__exit__(RuntimeError, error, None)
            assert later.result() is (not first_commits)
    assert _inbox(dsn, schema) == [("billing", "msg-4")]


def test_of_many_concurrent_receives_exactly_one_is_first(dsn: str, schema: str) -> None:
    threads = 8
    start = threading.Barrier(threads)

    def receive(_: int) -> bool:
        with psycopg.connect(dsn) as conn:
            start.wait()
            with outbox.transaction(conn, schema=schema) as tx:
                return tx.receive("billing", "msg-5")

    with ThreadPoolExecutor(threads) as pool:
        results = list(pool.map(receive, range(threads)))
    assert sorted(results) == [False] * (threads - 1) + [True]


def test_async_receive(dsn: str, schema: str) -> None:
    async def main() -> list[bool]:
        async with await psycopg.AsyncConnection.connect(dsn) as aconn:
            async with outbox.transaction(aconn, schema=schema) as tx:
                first = await tx.receive("billing", "msg-6")
            async with outbox.transaction(aconn, schema=schema) as tx:
                again = await tx.receive("billing", "msg-6")
            return [first, again]

    assert asyncio.run(main()) == [True, False]


def test_receive_many_says_which_messages_are_new_in_one_statement(
    dsn: str, schema: str
) -> None:
    with psycopg.connect(dsn) as conn:
        with outbox.transaction(conn, schema=schema) as tx:
            assert tx.receive("billing", "msg-1")
        with outbox.transaction(conn, schema=schema) as tx:
            assert tx.receive_many("billing", ["msg-1", "msg-2", "msg-3", "msg-2"]) == [
                False, True, True, False]  # an id repeated in the list is new once
            assert tx.receive_many("billing", []) == []
        with pytest.raises(RuntimeError), outbox.transaction(conn, schema=schema) as tx:
            assert tx.receive_many("billing", ["msg-4"]) == [True]
            raise RuntimeError("handling failed")  # rolled back: not received
        with pytest.raises(InvalidKey), outbox.transaction(conn, schema=schema) as tx:
            tx.receive_many("billing", ["msg-5", "bad\nid"])

    async def received_async() -> list[bool]:
        async with (await psycopg.AsyncConnection.connect(dsn) as aconn,
                    outbox.transaction(aconn, schema=schema) as atx):
            return await atx.receive_many("billing", ["msg-3", "msg-4"])

    assert asyncio.run(received_async()) == [False, True]
    assert _inbox(dsn, schema) == [("billing", f"msg-{n}") for n in (1, 2, 3, 4)]


def test_purge_inbox_deletes_old_rows_a_batch_at_a_time(dsn: str, schema: str) -> None:
    inbox = table(schema, "inbox")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(psycopg.sql.SQL(
            "INSERT INTO {} (consumer, message_id, received_at) "
            "SELECT 'billing', 'old-' || i, now() - interval '8 days' "
            "FROM generate_series(1, 5) i").format(inbox))
        conn.execute(psycopg.sql.SQL(
            "INSERT INTO {} (consumer, message_id) VALUES ('billing', 'new')").format(inbox))
        purge = queries(schema).purge_inbox
        week = 7 * 24 * 3600.0
        assert conn.execute(purge, {"age": week, "limit": 3}).rowcount == 3
        assert conn.execute(purge, {"age": week, "limit": 3}).rowcount == 2
        assert conn.execute(purge, {"age": week, "limit": 3}).rowcount == 0
    assert _inbox(dsn, schema) == [("billing", "new")]
