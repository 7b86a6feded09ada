"""The Kafka InboxConsumer on the mock cluster: once into PostgreSQL, offsets there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from psycopg import sql

import outbox
from effects.kafka import InboxConsumer, KafkaEvent
from effects.testing import KafkaMockCluster
from tests.crash.support import REPO, Worker

from .support import records
from .worker import record

Conn = psycopg.Connection[tuple[Any, ...]]
# The mock cluster lets a group member that left (or died) go only after its session
# timeout: the shortest the broker accepts, so a second consumer joins in seconds.
FAST_GROUP = {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500}


@pytest.fixture
def db(dsn: str, schema: str) -> Iterator[Conn]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE TABLE {}.handled "
                             "(seq bigserial, message_id text, part int, off bigint)")
                     .format(sql.Identifier(schema)))
        yield conn


def produce(bootstrap: str, topic: str, items: Sequence[tuple[str | None, str]]) -> None:
    """Messages with (outbox-key, message key); None: no outbox-key header."""
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True,
                         "log_level": 0})
    for outbox_key, key in items:
        headers: list[tuple[str, str | bytes | None]] = (
            [] if outbox_key is None else [("outbox-key", outbox_key.encode())])
        producer.produce(topic, json.dumps({"id": outbox_key}).encode(), key=key.encode(),
                         headers=headers)
    assert producer.flush(30) == 0


def handled(db: Conn, schema: str) -> list[str]:
    rows = db.execute(sql.SQL("SELECT message_id FROM {}.handled ORDER BY 1")
                      .format(sql.Identifier(schema))).fetchall()
    return [str(r[0]) for r in rows]


def stored_offsets(db: Conn, schema: str) -> dict[int, int]:
    rows = db.execute(sql.SQL("SELECT partition, next_offset FROM {}.kafka_offsets")
                      .format(sql.Identifier(schema))).fetchall()
    return {int(p): int(o) for p, o in rows}


def kafka_committed(kafka: KafkaMockCluster, topic: str) -> dict[int, int]:
    """The offsets group ``billing`` committed to Kafka for ``topic``, by partition."""
    reader = Consumer({"bootstrap.servers": kafka.bootstrap_servers, "group.id": "billing",
                       "log_level": 0})
    try:
        found = reader.committed([TopicPartition(topic, p) for p in range(4)], timeout=10)
    finally:
        reader.close()
    return {tp.partition: tp.offset for tp in found if tp.offset >= 0}


def consumer(dsn: str, schema: str, kafka: KafkaMockCluster, topic: str,
             handler: Any = record, **options: Any) -> InboxConsumer:
    options.setdefault("backoff", (0.05,))
    return InboxConsumer(dsn, handler, bootstrap_servers=kafka.bootstrap_servers,
                         topics=[topic], group="billing", schema=schema, config=FAST_GROUP,
                         **options)


def test_each_message_is_handled_once_and_its_offset_stored_with_it(
    dsn: str, schema: str, db: Conn, kafka: KafkaMockCluster, topic: str
) -> None:
    produce(kafka.bootstrap_servers, topic, [(f"evt-{n}", f"k{n % 5}") for n in range(40)])
    # The producer died between the broker's ack and done: the same event again.
    produce(kafka.bootstrap_servers, topic, [("evt-7", "k2")])

    first = consumer(dsn, schema, kafka, topic).run_until_idle()
    assert (first.handled, first.duplicates, first.failed) == (40, 1, 0)
    assert handled(db, schema) == sorted(f"evt-{n}" for n in range(40))
    ends = {r.partition: r.offset + 1 for r in records(kafka.bootstrap_servers, topic)}
    assert stored_offsets(db, schema) == ends

    produce(kafka.bootstrap_servers, topic, [("evt-40", "k0")])
    again = consumer(dsn, schema, kafka, topic).run_until_idle()
    # Resumed from the stored offsets: only the new message was read at all.
    assert (again.handled, again.duplicates) == (1, 0)
    assert len(handled(db, schema)) == 41


def test_a_failing_handler_is_retried_in_order_and_other_messages_commit(
    dsn: str, schema: str, db: Conn, kafka: KafkaMockCluster, topic: str
) -> None:
    produce(kafka.bootstrap_servers, topic, [(f"evt-{n}", "same") for n in range(5)]
            + [(f"other-{n}", "other") for n in range(3)])
    failures = {"evt-2": 2}

    def flaky(tx: outbox.Transaction, event: KafkaEvent) -> None:
        if failures.get(event.message_id, 0) > 0:
            failures[event.message_id] -= 1
            raise RuntimeError("not yet")
        record(tx, event)

    stats = consumer(dsn, schema, kafka, topic, flaky).run_until_idle()

    assert (stats.handled, stats.failed, stats.dead_lettered) == (8, 2, 0)
    committed = [str(r[0]) for r in db.execute(sql.SQL(
        "SELECT message_id FROM {}.handled ORDER BY seq").format(sql.Identifier(schema)))]
    assert [m for m in committed if m.startswith("evt")] == [f"evt-{n}" for n in range(5)]
    assert sorted(handled(db, schema)) == sorted(
        [f"evt-{n}" for n in range(5)] + [f"other-{n}" for n in range(3)])


def test_a_poison_message_is_parked_on_the_dead_letter_topic_and_skipped(
    dsn: str, schema: str, db: Conn, kafka: KafkaMockCluster, topic: str
) -> None:
    produce(kafka.bootstrap_servers, topic, [("evt-1", "k"), ("evt-poison", "k"), ("evt-3", "k")])

    def picky(tx: outbox.Transaction, event: KafkaEvent) -> None:
        if event.message_id == "evt-poison":
            raise ValueError("never valid")
        record(tx, event)

    stats = consumer(dsn, schema, kafka, topic, picky, max_attempts=3).run_until_idle()

    assert (stats.handled, stats.failed, stats.dead_lettered) == (2, 3, 1)
    assert handled(db, schema) == ["evt-1", "evt-3"]
    [parked] = records(kafka.bootstrap_servers, f"{topic}.dlq")
    assert parked.headers["outbox-key"] == b"evt-poison"
    assert parked.headers["outbox-dead-letter-reason"] == b"ValueError"
    assert parked.headers["outbox-original-topic"] == topic.encode()


def test_a_consumer_killed_between_commit_and_offset_commit_handles_exactly_once(
    dsn: str, schema: str, db: Conn, kafka: KafkaMockCluster, topic: str, tmp_path: Path
) -> None:
    # No outbox-key: the inbox alone would know them by topic:partition:offset; what is
    # shown here is that the restarted consumer does not even read them again.
    produce(kafka.bootstrap_servers, topic, [(None, f"k{n % 3}") for n in range(20)])
    env = dict(os.environ, OUTBOX_DATABASE_URL=dsn)
    log_path = tmp_path / "consumer.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.kafka.worker", "consume-hang-before-offset-commit",
             "--schema", schema, "--bootstrap", kafka.bootstrap_servers, "--topic", topic],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL)
    worker = Worker(proc, log_path)
    try:
        committed = worker.read_json_line()["committed"]
        worker.kill()  # kill -9 after the database commit, before Kafka heard of it
    finally:
        worker.cleanup()
    assert sorted(handled(db, schema)) == sorted(committed)
    # Kafka never heard of that batch: only PostgreSQL's offsets can keep it from being
    # read again.
    assert kafka_committed(kafka, topic) == {}

    stats = consumer(dsn, schema, kafka, topic).run_until_idle()

    assert stats.duplicates == 0  # sought to the stored offsets: nothing read twice
    assert stats.handled == 20 - len(committed)
    rows = db.execute(sql.SQL("SELECT part, off, count(*) FROM {}.handled GROUP BY 1, 2")
                      .format(sql.Identifier(schema))).fetchall()
    assert len(rows) == 20 and all(r[2] == 1 for r in rows)
