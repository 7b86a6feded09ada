"""Produce against librdkafka's mock cluster: key, headers, ledger, outcomes, dispatchers."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import psycopg
import pytest

import outbox
from effects.kafka import Produce
from effects.nats import canonical_json
from effects.testing import KafkaMockCluster

from .support import make_job, records

VALUE = {"order": 102, "total": {"currency": "eur", "amount": 2000}}


def run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


def test_produces_the_value_with_the_key_headers_and_returns_where_it_landed(
    kafka: KafkaMockCluster, topic: str
) -> None:
    job = make_job("evt-102", {"topic": topic, "value": VALUE, "headers": {"x-tenant": "t1"}},
                   ordering_key="order-102")
    with Produce(kafka.bootstrap_servers) as produce:
        result = run(produce.perform(job))

    [stored] = records(kafka.bootstrap_servers, topic)
    assert result == {"topic": topic, "partition": stored.partition, "offset": stored.offset}
    assert stored.value == canonical_json(VALUE)
    assert json.loads(stored.value) == VALUE
    assert stored.key == b"order-102"  # the ordering key, when the payload names none
    assert stored.headers == {"x-tenant": b"t1", "outbox-key": b"evt-102",
                              "outbox-event-time": b"2026-12-03T05:00:00.000000+00:00"}


def test_the_payloads_key_wins_and_a_job_without_one_has_no_key(
    kafka: KafkaMockCluster, topic: str
) -> None:
    with Produce(kafka.bootstrap_servers) as produce:
        run(produce.perform(make_job("evt-a", {"topic": topic, "key": "customer-7",
                                               "value": 1}, ordering_key="order-1")))
        run(produce.perform(make_job("evt-b", {"topic": topic, "value": 2})))

    keys = {r.headers["outbox-key"]: r.key for r in records(kafka.bootstrap_servers, topic)}
    assert keys == {b"evt-a": b"customer-7", b"evt-b": None}


def test_a_repeat_is_produced_again_with_the_same_bytes_and_outbox_key(
    kafka: KafkaMockCluster, topic: str
) -> None:
    # Kafka does not deduplicate by our key: a re-attempt is a second message that the
    # consumer recognises by its outbox-key.
    with Produce(kafka.bootstrap_servers) as produce:
        run(produce.perform(make_job("evt-1", {"topic": topic, "value": VALUE},
                                     ordering_key="o")))
        run(produce.perform(make_job("evt-1", {"topic": topic, "value": VALUE},
                                     ordering_key="o", attempt=2)))

    first, second = records(kafka.bootstrap_servers, topic)
    assert (first.value, first.key, first.headers) == (second.value, second.key, second.headers)


@pytest.mark.parametrize(("payload", "field"), [
    ({"value": 1}, "topic"),
    ({"topic": "has space", "value": 1}, "topic"),
    ({"topic": "t"}, "value"),
    ({"topic": "t", "value": math.nan}, "value"),
    ({"topic": "t", "value": 1, "headers": {"outbox-key": "x"}}, "headers"),
    ({"topic": "t", "value": 1, "extra": True}, "extra"),
])
def test_an_invalid_payload_is_permanent_before_any_network_call(
    payload: dict[str, Any], field: str
) -> None:
    # Nothing listens on port 9: a network call would give Retry, not Permanent.
    with Produce("127.0.0.1:9") as produce, pytest.raises(outbox.Permanent) as caught:
        run(produce.perform(make_job("evt-bad", payload)))
    assert field in caught.value.reason
    assert "evt-bad" in caught.value.reason


def test_a_message_too_large_is_permanent(kafka: KafkaMockCluster, topic: str) -> None:
    with Produce(kafka.bootstrap_servers) as produce, pytest.raises(
        outbox.Permanent, match="MSG_SIZE_TOO_LARGE"
    ):
        run(produce.perform(make_job("evt-big", {"topic": topic, "value": "x" * 2_000_000})))


def test_a_cluster_that_cannot_be_reached_is_retried_with_nothing_sent() -> None:
    with Produce("127.0.0.1:9", connect_timeout=1.0) as produce, pytest.raises(
        outbox.Retry, match="no Kafka broker reachable"
    ):
        run(produce.perform(make_job("evt-1", {"topic": "orders", "value": 1})))


def test_a_delivery_that_times_out_after_the_handover_is_an_unknown_outcome(topic: str) -> None:
    # A cluster of its own: its one broker goes down with the message handed over.
    with KafkaMockCluster(brokers=1) as cluster, \
            Produce(cluster.bootstrap_servers, delivery_timeout=1.0) as produce:
        run(produce.perform(make_job("evt-1", {"topic": topic, "value": 1})))
        cluster.set_broker_down(1)
        try:
            with pytest.raises(outbox.UnknownOutcome, match="evt-2.*_MSG_TIMED_OUT"):
                run(produce.perform(make_job("evt-2", {"topic": topic, "value": 2})))
        finally:
            cluster.set_broker_up(1)
        # The broker is back: the job's next attempt produces it.
        again = run(produce.perform(make_job("evt-2", {"topic": topic, "value": 2},
                                             attempt=2)))
        stored = records(cluster.bootstrap_servers, topic)
    where = {(r.partition, r.offset): r.headers["outbox-key"] for r in stored}
    assert where[(again["partition"], again["offset"])] == b"evt-2"


def test_the_mock_stores_a_retried_batch_again_when_its_ack_was_lost(topic: str) -> None:
    # One attempt, acknowledged once, and two copies in the topic: the broker stored the
    # message, went down before its response left, and the producer's own retry of the
    # batch was stored again. A real broker drops that retry as a duplicate of the
    # idempotent producer's sequence; librdkafka's mock checks sequences only for
    # transactional producers. The copies are the same batch: same partition, same
    # producer timestamp, which is how the chaos checks tell them from a second attempt.
    with KafkaMockCluster(brokers=1) as cluster, \
            Produce(cluster.bootstrap_servers, delivery_timeout=10.0) as produce:

        async def attempt_losing_its_ack() -> dict[str, Any]:
            await produce.perform(make_job("evt-0", {"topic": topic, "value": 0}))
            cluster.set_broker_rtt(1, 6000)  # evt-1 is stored at once, its ack held
            try:
                performing = asyncio.create_task(
                    produce.perform(make_job("evt-1", {"topic": topic, "value": 1})))
                # No event says "stored, ack held": the one broker answers every request,
                # a watermark query included, only after the same delay. So a pause well
                # inside the held 6 s, generous for the produce to reach the broker on a
                # loaded machine; too short a pause fails the count below, never passes it.
                await asyncio.sleep(1.5)
                cluster.set_broker_down(1)  # the held ack is dropped with the connection
            finally:
                cluster.set_broker_rtt(1, 0)
                cluster.set_broker_up(1)
            result: dict[str, Any] = await performing
            return result

        result = run(attempt_losing_its_ack())
        stored = [r for r in records(cluster.bootstrap_servers, topic)
                  if r.headers["outbox-key"] == b"evt-1"]
    assert len(stored) == 2
    assert {(r.partition, r.timestamp) for r in stored} == {(stored[0].partition,
                                                              stored[0].timestamp)}
    assert (result["partition"], result["offset"]) in {(r.partition, r.offset) for r in stored}


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_dispatchers_produce_every_job_once_in_order_per_ordering_key(
    dsn: str, schema: str, kafka: KafkaMockCluster, topic: str, flavour: str
) -> None:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue_many([outbox.NewJob("kafka.produce", key=f"evt-{n}", ordering_key=f"o{n % 3}",
                                       payload={"topic": topic, "value": {"n": n}})
                         for n in range(30)])
    with Produce(kafka.bootstrap_servers) as produce:
        if flavour == "sync":
            stats = outbox.Dispatcher(dsn, [produce], schema=schema).run_until_idle(60)
        else:
            stats = run(outbox.AsyncDispatcher(dsn, [produce], schema=schema,
                                               concurrency=16).run_until_idle(60))

    assert stats.done == 30
    stored = records(kafka.bootstrap_servers, topic)
    assert sorted(r.headers["outbox-key"] for r in stored) == sorted(
        f"evt-{n}".encode() for n in range(30))
    for key in (b"o0", b"o1", b"o2"):  # one partition per key, in enqueue order
        mine = [json.loads(r.value)["n"] for r in stored if r.key == key]
        assert mine == sorted(mine)
        assert len({r.partition for r in stored if r.key == key}) == 1
    with psycopg.connect(dsn) as conn:
        results = conn.execute(f'SELECT result FROM "{schema}".effect_results').fetchall()
    assert {(r[0]["topic"], r[0]["partition"], r[0]["offset"]) for r in results} == {
        (topic, r.partition, r.offset) for r in stored}
