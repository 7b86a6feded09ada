"""envelope="cloudevents" on kafka.produce: a binary-mode event the SDK reads."""

from __future__ import annotations

import asyncio

from cloudevents.core.bindings import kafka as ce_kafka
from cloudevents.core.formats.json import JSONFormat

from effects.kafka import Produce
from effects.testing import KafkaMockCluster

from .support import make_job, records


def test_a_kafka_message_is_a_binary_cloudevent_the_sdk_reads(
    kafka: KafkaMockCluster, topic: str
) -> None:
    job = make_job("evt-102", {"topic": topic, "value": {"order": 102}}, ordering_key="o-102")
    with Produce(kafka.bootstrap_servers, envelope="cloudevents", source="/shop") as produce:
        asyncio.run(produce.perform(job))

    [stored] = records(kafka.bootstrap_servers, topic)
    event = ce_kafka.from_binary(ce_kafka.KafkaMessage(stored.headers, stored.key, stored.value),
                                 JSONFormat())
    assert (event.get_id(), event.get_source(), event.get_type()) == ("evt-102", "/shop", topic)
    assert (event.get_specversion(), event.get_time(), event.get_data()) == (
        "1.0", job.first_attempted_at, {"order": 102})
    assert event.get_datacontenttype() == "application/json"
    assert stored.headers["outbox-key"] == b"evt-102"
