"""InboxConsumer: each message handled once through the inbox, poison parked, not looped."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import psycopg
import pytest
from psycopg import sql

import outbox
from effects.nats import InboxConsumer, InboxEvent, PublishEvent
from effects.testing import NatsServer
from outbox.testing import jobs

from .support import add_stream, delete_stream, make_job, messages, run
from .test_crash import start_worker
from .worker import record

Conn = psycopg.Connection[tuple[Any, ...]]


@pytest.fixture
def db(dsn: str, schema: str) -> Iterator[Conn]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE TABLE {}.handled (message_id text, deliveries int)")
                     .format(sql.Identifier(schema)))
        yield conn


@pytest.fixture
def streams(nats_server: NatsServer) -> Iterator[tuple[str, str]]:
    """An events stream and a dead-letter stream capturing ``DLQ.<events>.>``."""
    events = add_stream(nats_server.url, duplicate_window=120.0)
    dead = add_stream(nats_server.url, subjects=[f"DLQ.{events}.>"], duplicate_window=120.0)
    yield events, dead
    delete_stream(nats_server.url, events)
    delete_stream(nats_server.url, dead)


def publish(url: str, subject: str, data: bytes, message_id: str,
            nats_msg_id: str | None = None) -> None:
    async def send() -> None:
        client = await nats.connect(url)
        try:
            await client.jetstream().publish(subject, data, headers={
                "Outbox-Message-Id": message_id, "Nats-Msg-Id": nats_msg_id or message_id})
        finally:
            await client.close()

    run(send())


def handled(db: Conn, schema: str) -> list[tuple[str, int]]:
    rows = db.execute(sql.SQL("SELECT message_id, deliveries FROM {}.handled ORDER BY 1, 2")
                      .format(sql.Identifier(schema))).fetchall()
    return [(str(m), int(d)) for m, d in rows]


def inbox(db: Conn, schema: str) -> list[tuple[str, str]]:
    rows = db.execute(sql.SQL("SELECT consumer, message_id FROM {}.inbox ORDER BY 2")
                      .format(sql.Identifier(schema))).fetchall()
    return [(str(c), str(m)) for c, m in rows]


def consumer(dsn: str, schema: str, url: str, stream: str, handler: Any = record,
             **options: Any) -> InboxConsumer:
    options.setdefault("backoff", (0.05,))
    return InboxConsumer(dsn, handler, servers=url, stream=stream, name="billing",
                         schema=schema, ack_wait=2.0, dead_letter_subject=f"DLQ.{stream}.billing",
                         **options)


@pytest.mark.parametrize("pipeline", [False, True])
def test_each_message_is_handled_once_and_recorded_in_the_inbox(
    dsn: str, schema: str, db: Conn, nats_server: NatsServer, streams: tuple[str, str],
    pipeline: bool,
) -> None:
    events, _ = streams
    for n in range(3):
        publish(nats_server.url, f"{events}.orders.paid", b'{"n": %d}' % n, f"evt-{n}")

    stats = run(consumer(dsn, schema, nats_server.url, events,
                         pipeline=pipeline).run_until_idle())

    assert (stats.handled, stats.duplicates, stats.failed) == (3, 0, 0)
    assert handled(db, schema) == [("evt-0", 1), ("evt-1", 1), ("evt-2", 1)]
    assert inbox(db, schema) == [("billing", f"evt-{n}") for n in range(3)]


def test_a_repeat_the_broker_stored_twice_is_handled_once(
    dsn: str, schema: str, db: Conn, nats_server: NatsServer, streams: tuple[str, str]
) -> None:
    # Past the duplicate window the broker stores a re-sent event again: the inbox
    # recognises it by the outbox message id.
    events, _ = streams
    publish(nats_server.url, f"{events}.orders.paid", b"{}", "evt-1", nats_msg_id="a")
    publish(nats_server.url, f"{events}.orders.paid", b"{}", "evt-1", nats_msg_id="b")

    stats = run(consumer(dsn, schema, nats_server.url, events).run_until_idle())

    assert (stats.handled, stats.duplicates) == (1, 1)
    assert handled(db, schema) == [("evt-1", 1)]


def test_a_handler_that_raises_rolls_back_and_the_redelivery_is_handled(
    dsn: str, schema: str, db: Conn, nats_server: NatsServer, streams: tuple[str, str]
) -> None:
    events, _ = streams
    publish(nats_server.url, f"{events}.orders.paid", b"{}", "evt-1")
    seen: list[int] = []

    def flaky(tx: outbox.Transaction, event: InboxEvent) -> None:
        seen.append(event.deliveries)
        record(tx, event)  # written, then rolled back with the inbox row
        if event.deliveries == 1:
            raise RuntimeError("database of the payments team is down")

    stats = run(consumer(dsn, schema, nats_server.url, events, flaky).run_until_idle())

    assert seen == [1, 2]
    assert (stats.handled, stats.failed, stats.dead_lettered) == (1, 1, 0)
    assert handled(db, schema) == [("evt-1", 2)]


@pytest.mark.parametrize("pipeline", [False, True])
def test_a_handler_failing_in_a_batch_rolls_back_only_its_own_message(
    dsn: str, schema: str, db: Conn, nats_server: NatsServer, streams: tuple[str, str],
    pipeline: bool,
) -> None:
    events, _ = streams
    for n in range(6):
        publish(nats_server.url, f"{events}.orders.paid", b"{}", f"evt-{n}")
    calls: list[tuple[str, int]] = []

    def flaky(tx: outbox.Transaction, event: InboxEvent) -> None:
        calls.append((event.message_id, event.deliveries))
        record(tx, event)  # written, then rolled back with its inbox row
        if event.message_id == "evt-3" and event.deliveries == 1:
            raise RuntimeError("this message only")

    stats = run(consumer(dsn, schema, nats_server.url, events, flaky,
                         pipeline=pipeline).run_until_idle())

    assert (stats.handled, stats.failed, stats.duplicates) == (6, 1, 0)
    # Every message committed once; evt-3 on its second delivery, the others on the first.
    assert handled(db, schema) == [(f"evt-{n}", 2 if n == 3 else 1) for n in range(6)]
    assert len(inbox(db, schema)) == 6
    # The failing handler ran once per delivery; those before it in the batch ran again
    # under their savepoints (called at least once, committed once).
    assert calls.count(("evt-3", 1)) == calls.count(("evt-3", 2)) == 1
    assert all(calls.count((f"evt-{n}", 1)) == 1 for n in (4, 5))


def test_a_pipelined_statement_that_fails_fails_only_its_message_and_tx_calls_answer(
    dsn: str, schema: str, db: Conn, nats_server: NatsServer, streams: tuple[str, str]
) -> None:
    events, _ = streams
    for n in range(4):
        publish(nats_server.url, f"{events}.orders.paid", b"{}", f"evt-{n}")
    follow_ups: list[tuple[str, bool]] = []

    async def handler(tx: outbox.AsyncTransaction, event: InboxEvent) -> None:
        await tx.connection.execute(
            sql.SQL("INSERT INTO {}.handled (message_id, deliveries) VALUES (%s, %s)")
            .format(sql.Identifier(tx.schema)), (event.message_id, event.deliveries))
        if event.message_id == "evt-1" and event.deliveries == 1:
            # Pipelined: the error is known only at a later sync point, past this handler.
            await tx.connection.execute("SELECT 1 / 0")
        # tx's own calls wait for their answers, even in the pipeline.
        created = await tx.enqueue("noop", key=f"after-{event.message_id}", payload={})
        follow_ups.append((event.message_id, created.created))

    stats = run(consumer(dsn, schema, nats_server.url, events, handler,
                         pipeline=True).run_until_idle())

    assert (stats.handled, stats.failed, stats.duplicates) == (4, 1, 0)
    assert stats.errors == ["DivisionByZero"]
    assert handled(db, schema) == [(f"evt-{n}", 2 if n == 1 else 1) for n in range(4)]
    assert all(created for _, created in follow_ups)  # each pass rolled back its own
    assert sorted(jobs(db, schema)) == [f"after-evt-{n}" for n in range(4)]


def test_messages_after_a_failed_one_with_its_ordering_key_wait_for_it(
    dsn: str, schema: str, db: Conn, nats_server: NatsServer, streams: tuple[str, str]
) -> None:
    events, _ = streams
    sent = [("a-1", "A"), ("b-1", "B"), ("a-2", "A"), ("a-3", "A"), ("b-2", "B")]

    async def send() -> None:
        client = await nats.connect(nats_server.url)
        try:
            for message_id, key in sent:
                await client.jetstream().publish(f"{events}.orders.paid", b"{}", headers={
                    "Outbox-Message-Id": message_id, "Outbox-Ordering-Key": key})
        finally:
            await client.close()

    run(send())
    order: list[str] = []

    def flaky(tx: outbox.Transaction, event: InboxEvent) -> None:
        if event.message_id == "a-1" and event.deliveries == 1:
            raise RuntimeError("first of its key fails once")
        record(tx, event)
        order.append(event.message_id)  # reached only by handlers that commit

    stats = run(consumer(dsn, schema, nats_server.url, events, flaky).run_until_idle())

    assert stats.handled == 5
    assert [m for m in order if m.startswith("a")] == ["a-1", "a-2", "a-3"]
    # Key B did not wait for key A: handled in the first batch, before a-1.
    assert order.index("b-2") < order.index("a-1")
    assert sorted(m for m, _ in handled(db, schema)) == sorted(m for m, _ in sent)


def test_a_poison_message_is_parked_after_max_deliver_and_not_looped(
    dsn: str, schema: str, db: Conn, nats_server: NatsServer, streams: tuple[str, str]
) -> None:
    events, dead = streams
    # Published as the outbox does (with Nats-Expected-Stream), parked on another stream.
    with PublishEvent(nats_server.url, events) as publisher:
        run(publisher.perform(make_job("evt-poison", {"subject": f"{events}.orders.paid",
                                                      "data": "not json"})))
    publish(nats_server.url, f"{events}.orders.paid", b'{"ok": true}', "evt-fine")
    calls: list[str] = []

    def parse(tx: outbox.Transaction, event: InboxEvent) -> None:
        calls.append(event.message_id)
        if not isinstance(event.json(), dict):  # the poison message, every time
            raise ValueError("an order event must be a JSON object")
        record(tx, event)

    stats = run(consumer(dsn, schema, nats_server.url, events, parse,
                         max_deliver=3).run_until_idle())

    assert calls.count("evt-poison") == 3
    assert (stats.handled, stats.failed, stats.dead_lettered) == (1, 3, 1)
    assert handled(db, schema) == [("evt-fine", 1)]
    assert inbox(db, schema) == [("billing", "evt-fine")]
    [parked] = messages(nats_server.url, dead)
    assert parked.data == b'"not json"'
    assert parked.subject == f"DLQ.{events}.billing"
    assert parked.headers["Outbox-Message-Id"] == "evt-poison"
    assert parked.headers["Outbox-Deliveries"] == "3"
    assert parked.headers["Outbox-Dead-Letter-Reason"] == "ValueError"
    assert parked.headers["Outbox-Original-Subject"] == f"{events}.orders.paid"


def test_a_consumer_killed_between_commit_and_ack_does_not_handle_twice(
    dsn: str, schema: str, db: Conn, nats_server: NatsServer, streams: tuple[str, str],
    tmp_path: Path,
) -> None:
    events, _ = streams
    publish(nats_server.url, f"{events}.orders.paid", b"{}", "evt-1")

    worker = start_worker("consume-hang-before-ack", dsn, schema, nats_server, events,
                          tmp_path)
    try:
        worker.read_json_line()  # committed; the ack is never sent
        assert handled(db, schema) == [("evt-1", 1)]
        worker.kill()
    finally:
        worker.cleanup()

    # The same durable consumer, restarted: the message comes again after ack_wait.
    stats = run(consumer(dsn, schema, nats_server.url, events).run_until_idle())

    assert (stats.handled, stats.duplicates) == (0, 1)
    assert handled(db, schema) == [("evt-1", 1)]


def test_run_stops_when_asked_from_the_handlers_thread(
    dsn: str, schema: str, db: Conn, nats_server: NatsServer, streams: tuple[str, str]
) -> None:
    events, _ = streams
    publish(nats_server.url, f"{events}.orders.paid", b"{}", "evt-1")

    def record_and_stop(tx: outbox.Transaction, event: InboxEvent) -> None:
        record(tx, event)
        inbox_consumer.stop()

    inbox_consumer = consumer(dsn, schema, nats_server.url, events, record_and_stop)
    stats = run(asyncio.wait_for(inbox_consumer.run(), 60))

    assert stats.handled == 1
    assert handled(db, schema) == [("evt-1", 1)]


def test_an_async_handler_runs_once_per_message_on_an_async_transaction(
    dsn: str, schema: str, db: Conn, nats_server: NatsServer, streams: tuple[str, str]
) -> None:
    events, _ = streams
    publish(nats_server.url, f"{events}.orders.paid", b"{}", "evt-1")
    publish(nats_server.url, f"{events}.orders.paid", b"{}", "evt-1", nats_msg_id="again")
    publish(nats_server.url, f"{events}.orders.paid", b"{}", "evt-2")
    insert = sql.SQL("INSERT INTO {}.handled (message_id, deliveries) VALUES (%s, %s)").format(
        sql.Identifier(schema))

    async def record_async(tx: outbox.AsyncTransaction, event: InboxEvent) -> None:
        await tx.connection.execute(insert, (event.message_id, event.deliveries))
        if event.message_id == "evt-2" and event.deliveries == 1:
            raise RuntimeError("first delivery fails")

    stats = run(consumer(dsn, schema, nats_server.url, events, record_async).run_until_idle())

    assert (stats.handled, stats.duplicates, stats.failed) == (2, 1, 1)
    assert handled(db, schema) == [("evt-1", 1), ("evt-2", 2)]
