"""Reading a topic back, and jobs as the dispatcher hands them over."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from confluent_kafka import Consumer, TopicPartition

import outbox


@dataclass(frozen=True)
class Record:
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    headers: dict[str, bytes]
    timestamp: int = 0  # the producer's, in ms (CreateTime)


def records(bootstrap: str, topic: str, partitions: int = 4) -> list[Record]:
    """Every message of ``topic`` (a consumer assigned to every partition, from the start)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex,
                         "enable.auto.commit": False, "log_level": 0})
    try:
        counts, starts = {}, {}
        for p in range(partitions):
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            if high > low:
                counts[p], starts[p] = high - low, low
        consumer.assign([TopicPartition(topic, p, starts[p]) for p in counts])
        found: list[Record] = []
        while len(found) < sum(counts.values()):
            message = consumer.poll(10)
            assert message is not None, "a message of the topic did not arrive"
            assert message.error() is None, message.error()
            found.append(Record(message.partition() or 0, message.offset() or 0,
                                message.key(), message.value() or b"",
                                _headers(message.headers()), message.timestamp()[1]))
        return sorted(found, key=lambda r: (r.partition, r.offset))
    finally:
        consumer.close()


def _headers(raw: Any) -> dict[str, bytes]:
    return {str(item[0]): bytes(item[1] or b"") for item in raw or []}


def make_job(key: str, payload: dict[str, Any], *, attempt: int = 1,
             ordering_key: str | None = None) -> outbox.Job:
    """A ``kafka.produce`` job as the dispatcher hands it over."""
    return outbox.Job(id=1, effect="kafka.produce", key=key, payload=payload, attempt=attempt,
                      claim_version=attempt, ordering_key=ordering_key, max_attempts=25,
                      first_attempted_at=datetime(2026, 12, 3, 5, 0, tzinfo=UTC))
