"""Section ``events``: the broker paths beside their raw clients, in the same run.

``nats.publish``: 20,000 events enqueued as ``nats.publish`` jobs and drained by one
``AsyncDispatcher`` at concurrency 256 with ``PublishEvent`` (wall clock from the call to
its return), against plain nats-py publishing the same number of events from 256
coroutines on one connection, each with a ``Nats-Msg-Id`` and its acknowledgement
awaited. Both publish to a fresh stream of the same nats-server; afterwards the stream
must hold exactly one message per event and every job must be ``done``.

``InboxConsumer``: 20,000 messages already in a stream, consumed by ``InboxConsumer``
with a handler inserting one row per message (stopped by the handler at the last
message; ``pipeline=True``, so the inserts are pipelined), against a raw nats-py pull
consumer doing the same work the plain way: fetch 256, one transaction per batch with one
INSERT per message (psycopg's ``executemany``, pipelined), commit, then ack each (acks
are not answered) and flush. Each gets a durable consumer of its own and a fresh
database; afterwards each message must have exactly one row.

``kafka.produce``: 20,000 ``kafka.produce`` jobs drained by one ``AsyncDispatcher`` at
concurrency 256 with ``Produce``, against confluent-kafka producing the same number of
messages with the same producer settings (idempotent, acks=all) and waiting for every
delivery report, both to librdkafka's mock cluster (3 brokers, in a process of its own);
afterwards each topic must hold exactly one message per event.

Everything runs in this process, one measurement after the other, interleaved per run.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

import nats
import psycopg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig
from psycopg import sql

import outbox

from ._db import Server, fresh_database, migrated, scalar, settle, table
from ._results import Row, Section, Target
from ._stats import Figure, ratios

CHUNK = 5000


@dataclass(frozen=True)
class EventsConfig:
    runs: int
    publish_events: int = 20_000
    publish_concurrency: int = 256
    inbox_messages: int = 20_000
    fetch: int = 256


# -- helpers -----------------------------------------------------------------------------


async def _stream(url: str, name: str) -> None:
    client = await nats.connect(url)
    try:
        await client.jetstream().add_stream(StreamConfig(
            name=name, subjects=[f"{name}.>"], duplicate_window=600.0))
    finally:
        await client.close()


async def _stored(url: str, name: str) -> int:
    client = await nats.connect(url)
    try:
        info = await client.jetstream().stream_info(name)
        return int(info.state.messages)
    finally:
        await client.close()


def _new_stream(url: str) -> str:
    name = f"B{uuid.uuid4().hex[:10].upper()}"
    asyncio.run(_stream(url, name))
    return name


# -- nats.publish ------------------------------------------------------------------------


async def _raw_publish(url: str, stream: str, events: int, concurrency: int) -> float:
    client = await nats.connect(url)
    js = client.jetstream()
    subject = f"{stream}.orders.paid"
    next_event = 0

    async def publisher() -> None:
        nonlocal next_event
        while next_event < events:
            n, next_event = next_event, next_event + 1
            await js.publish(subject, b'{"order":%d}' % n, stream=stream,
                             headers={"Nats-Msg-Id": f"evt-{n}"})

    try:
        started = time.perf_counter()
        await asyncio.gather(*(publisher() for _ in range(concurrency)))
        return events / (time.perf_counter() - started)
    finally:
        await client.close()


def _ours_publish(server: Server, url: str, stream: str, events: int,
                  concurrency: int) -> float:
    from effects.nats import PublishEvent

    with fresh_database(server, "publish") as dsn:
        migrated(dsn)
        with psycopg.connect(dsn) as conn:
            for first in range(0, events, CHUNK):
                with outbox.transaction(conn) as tx:
                    tx.enqueue_many([outbox.NewJob("nats.publish", key=f"evt-{n}", payload={
                        "subject": f"{stream}.orders.paid", "data": {"order": n}})
                        for n in range(first, min(events, first + CHUNK))])
        settle(dsn)
        with PublishEvent(url, stream) as publisher:
            publisher.check()
            dispatcher = outbox.AsyncDispatcher(dsn, [publisher], concurrency=concurrency)
            started = time.perf_counter()
            stats = asyncio.run(dispatcher.run_until_idle(timeout=600))
            rate = events / (time.perf_counter() - started)
        done = scalar(dsn, sql.SQL("SELECT count(*) FROM {} WHERE status = 'done'")
                      .format(table("outbox", "jobs")))
    if stats.done != events or done != events:
        raise AssertionError(f"nats.publish: {done} of {events} jobs done")
    return rate


def _publish_run(server: Server, url: str, config: EventsConfig) -> dict[str, float]:
    n, c = config.publish_events, config.publish_concurrency
    raw_stream, our_stream = _new_stream(url), _new_stream(url)
    raw = asyncio.run(_raw_publish(url, raw_stream, n, c))
    ours = _ours_publish(server, url, our_stream, n, c)
    for stream in (raw_stream, our_stream):
        stored = asyncio.run(_stored(url, stream))
        if stored != n:
            raise AssertionError(f"stream {stream} holds {stored} messages, not {n}")
    return {"raw": raw, "ours": ours}


# -- the inbox consumer -------------------------------------------------------------------


async def _fill(url: str, stream: str, messages: int) -> None:
    client = await nats.connect(url)
    js = client.jetstream()
    try:
        for first in range(0, messages, 1000):
            await asyncio.gather(*(js.publish(
                f"{stream}.orders.paid", b'{"order":%d}' % n, stream=stream,
                headers={"Nats-Msg-Id": f"msg-{n}", "Outbox-Message-Id": f"msg-{n}"})
                for n in range(first, min(messages, first + 1000))))
    finally:
        await client.close()


def _handled_table(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE handled (message_id text NOT NULL, body bytea)")


def _distinct_handled(dsn: str, messages: int) -> None:
    count, distinct = (scalar(dsn, q) for q in (
        "SELECT count(*) FROM handled", "SELECT count(DISTINCT message_id) FROM handled"))
    if count != messages or distinct != messages:
        raise AssertionError(f"{count} rows for {distinct} of {messages} messages")


_INSERT = "INSERT INTO handled (message_id, body) VALUES (%s, %s)"


async def _raw_consume(dsn: str, url: str, stream: str, messages: int, fetch: int) -> float:
    client = await nats.connect(url)
    js: JetStreamContext = client.jetstream()
    config = ConsumerConfig(durable_name="raw", ack_policy=AckPolicy.EXPLICIT)
    subscription = await js.pull_subscribe(f"{stream}.>", durable="raw", stream=stream,
                                           config=config)
    db = await psycopg.AsyncConnection.connect(dsn)
    consumed = 0
    try:
        started = time.perf_counter()
        while consumed < messages:
            batch = await subscription.fetch(fetch, timeout=5)
            async with db.transaction(), db.cursor() as cursor:
                # executemany pipelines the inserts: one round trip for the batch.
                await cursor.executemany(_INSERT, [
                    ((message.headers or {})["Outbox-Message-Id"], message.data)
                    for message in batch])
            for message in batch:
                await message.ack()
            await client.flush()
            consumed += len(batch)
        return messages / (time.perf_counter() - started)
    finally:
        await db.close()
        await client.close()


def _ours_consume(dsn: str, url: str, stream: str, messages: int, fetch: int) -> float:
    from effects.nats import InboxConsumer, InboxEvent

    handled = 0

    async def handler(tx: outbox.AsyncTransaction, event: InboxEvent) -> None:
        nonlocal handled
        await tx.connection.execute(_INSERT, (event.message_id, event.data))
        handled += 1
        if handled == messages:
            consumer.stop()  # returns once this batch is committed and acked

    consumer = InboxConsumer(dsn, handler, servers=url, stream=stream, name="ours",
                             subject=f"{stream}.>", batch=fetch, pipeline=True)
    started = time.perf_counter()
    stats = asyncio.run(consumer.run())
    rate = messages / (time.perf_counter() - started)
    if stats.handled != messages:
        raise AssertionError(f"InboxConsumer handled {stats.handled} of {messages}")
    return rate


def _inbox_run(server: Server, url: str, config: EventsConfig) -> dict[str, float]:
    n = config.inbox_messages
    stream = _new_stream(url)
    asyncio.run(_fill(url, stream, n))
    result = {}
    with fresh_database(server, "inbox_raw") as dsn:
        _handled_table(dsn)
        result["raw"] = asyncio.run(_raw_consume(dsn, url, stream, n, config.fetch))
        _distinct_handled(dsn, n)
    with fresh_database(server, "inbox") as dsn:
        migrated(dsn)
        _handled_table(dsn)
        result["ours"] = _ours_consume(dsn, url, stream, n, config.fetch)
        _distinct_handled(dsn, n)
    return result


# -- kafka.produce -----------------------------------------------------------------------


def _raw_produce(bootstrap: str, topic: str, events: int) -> float:
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True,
                         "acks": "all", "log_level": 0})
    failed: list[object] = []

    def report(error: object, _message: object) -> None:
        if error is not None:
            failed.append(error)

    started = time.perf_counter()
    for n in range(events):
        while True:
            try:
                producer.produce(topic, b'{"order":%d}' % n, headers=[("outbox-key", b"e%d" % n)],
                                 on_delivery=report)
                break
            except BufferError:
                producer.poll(0.01)
        producer.poll(0)
    if producer.flush(60) != 0 or failed:
        raise AssertionError(f"confluent-kafka: {len(failed)} deliveries failed")
    return events / (time.perf_counter() - started)


def _ours_produce(server: Server, bootstrap: str, topic: str, events: int,
                  concurrency: int) -> float:
    from effects.kafka import Produce

    with fresh_database(server, "produce") as dsn:
        migrated(dsn)
        with psycopg.connect(dsn) as conn:
            for first in range(0, events, CHUNK):
                with outbox.transaction(conn) as tx:
                    tx.enqueue_many([outbox.NewJob("kafka.produce", key=f"evt-{n}", payload={
                        "topic": topic, "value": {"order": n}})
                        for n in range(first, min(events, first + CHUNK))])
        settle(dsn)
        with Produce(bootstrap) as produce:
            dispatcher = outbox.AsyncDispatcher(dsn, [produce], concurrency=concurrency)
            started = time.perf_counter()
            stats = asyncio.run(dispatcher.run_until_idle(timeout=600))
            rate = events / (time.perf_counter() - started)
    if stats.done != events:
        raise AssertionError(f"kafka.produce: {stats.done} of {events} jobs done")
    return rate


def _topic_size(bootstrap: str, topic: str) -> int:
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex,
                         "log_level": 0})
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        total = 0
        for p in partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            total += high - low
        return total
    finally:
        consumer.close()


def _produce_run(server: Server, bootstrap: str, config: EventsConfig) -> dict[str, float]:
    n = config.publish_events
    raw_topic, our_topic = f"raw-{uuid.uuid4().hex[:8]}", f"ours-{uuid.uuid4().hex[:8]}"
    result = {"raw": _raw_produce(bootstrap, raw_topic, n),
              "ours": _ours_produce(server, bootstrap, our_topic, n,
                                    config.publish_concurrency)}
    for topic in (raw_topic, our_topic):
        if (size := _topic_size(bootstrap, topic)) != n:
            raise AssertionError(f"topic {topic} holds {size} messages, not {n}")
    return result


# -- the section ---------------------------------------------------------------------------


def run(server: Server, config: EventsConfig) -> Section:
    """Each measurement ``config.runs`` times, interleaved, on one nats-server."""
    from effects.testing import KafkaMockCluster, NatsServer

    publish: list[dict[str, float]] = []
    inbox: list[dict[str, float]] = []
    produce: list[dict[str, float]] = []
    with NatsServer() as nats_server, KafkaMockCluster() as kafka:
        for _ in range(config.runs):
            publish.append(_publish_run(server, nats_server.url, config))
            inbox.append(_inbox_run(server, nats_server.url, config))
            produce.append(_produce_run(server, kafka.bootstrap_servers, config))
    rows = [
        _row(f"nats.publish, {config.publish_events:,} events, AsyncDispatcher "
             f"concurrency {config.publish_concurrency}", "events/s", publish,
             "nats-py publish, acks awaited", Target(">=", 0.5)),
        _row(f"InboxConsumer, {config.inbox_messages:,} messages, batch {config.fetch}, "
             "an INSERT each", "msgs/s", inbox, "nats-py pull consumer + INSERT",
             Target(">=", 0.5)),
        Row("events", "InboxConsumer msgs/s", "msgs/s", Figure.of([r["ours"] for r in inbox]),
            target=Target(">=", 5000, on="value")),
        _row(f"kafka.produce, {config.publish_events:,} events, AsyncDispatcher concurrency "
             f"{config.publish_concurrency}, mock cluster", "events/s", produce,
             "confluent-kafka produce, every report awaited", None),
    ]
    settings = {"nats.publish": f"AsyncDispatcher(concurrency={config.publish_concurrency}), "
                "other options default; PublishEvent defaults",
                "inbox": f"InboxConsumer(batch={config.fetch}, pipeline=True), async handler",
                "kafka.produce": "Produce defaults (idempotent, acks=all) on librdkafka's mock "
                "cluster, 3 brokers"}
    return Section("events", rows, raw={"config": vars(config), "publish": publish,
                                        "inbox": inbox, "produce": produce}, settings=settings)


def _row(name: str, unit: str, runs: list[dict[str, float]], baseline: str,
         target: Target | None) -> Row:
    ours, raw = [r["ours"] for r in runs], [r["raw"] for r in runs]
    return Row("events", name, unit, Figure.of(ours), baseline, Figure.of(raw),
               ratios(ours, raw), target)
