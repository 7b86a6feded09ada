"""The Kafka checks of the chaos runner catch what they are there for: a repeat no
attempt explains, a key handled twice, a ledger naming another message; and they tell
the copies of one batch the mock cluster stored twice (one attempt) from a repeat.
(The runs in test_chaos show them passing; a checker that cannot fail proves nothing.)"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import Producer

from effects.chaos.checks import Findings, JobRow, _check_kafka
from effects.chaos.kafka import TOPIC, ChaosKafka


class Topic:
    """What the checks read of the run's topic: the key at each (partition, offset), and
    the producer's timestamp of each (by default one of its own per message)."""

    def __init__(self, at: dict[tuple[int, int], str],
                 stamps: dict[tuple[int, int], int] | None = None) -> None:
        self.at = at
        self.stamps = stamps if stamps is not None else {
            where: n for n, where in enumerate(sorted(at))}
        self.consumer_stats: Counter[str] = Counter()
        self.consumer_kills = self.consumer_stops = self.brokers_down = 0

    def messages_per_key(self) -> dict[str, int]:
        return dict(Counter(self.at.values()))

    def produced_per_key(self) -> dict[str, int]:
        return dict(Counter(key for key, _, _ in {
            (key, p, self.stamps[(p, o)]) for (p, o), key in self.at.items()}))

    def key_at(self, partition: int, offset: int) -> str | None:
        return self.at.get((partition, offset))

    def keys_in(self, partition: int) -> set[str]:
        return {key for (p, _), key in self.at.items() if p == partition}

    def dead_letters(self) -> int:
        return 0


def done(key: str, version: int, partition: int, offset: int | None) -> JobRow:
    return JobRow(1, key, "kafka.produce", "done", version, version, None, 1, version,
                  {"topic": "chaos-events", "partition": partition, "offset": offset})


def check(at: dict[tuple[int, int], str], rows: list[JobRow], consumed: dict[str, int],
          attempts: list[tuple[Any, ...]],
          stamps: dict[tuple[int, int], int] | None = None) -> Findings:
    findings = Findings()
    _check_kafka(findings, SimpleNamespace(kafka=Topic(at, stamps)),  # type: ignore[arg-type]
                 rows, consumed, attempts)
    return findings


def test_a_repeat_after_an_acked_attempt_that_never_got_done_passes() -> None:
    # Claim 1 was acked, then its worker died before done; claim 2 produced it again.
    findings = check({(0, 0): "k", (0, 1): "k"}, [done("k", 2, 0, 1)], {"k": 1},
                     [("k", 1, "ok", 2, "done"), ("k", 2, "ok", 2, "done")])
    assert sum(findings.counts.values()) == 0, findings.violations
    assert findings.kafka["keys_per_count"] == {"2": 1}
    assert findings.kafka["acked_not_done"] == 1


def test_a_repeat_no_attempt_explains_is_flagged() -> None:
    # The first attempt ended Retry ("nothing sent"), yet two messages are stored.
    findings = check({(0, 0): "k", (0, 1): "k"}, [done("k", 2, 0, 1)], {"k": 1},
                     [("k", 1, "Retry: no Kafka broker reachable", 2, "done"),
                      ("k", 2, "ok", 2, "done")])
    assert findings.counts["kafka_unexplained_repeats"] == 1


def test_copies_of_one_batch_the_mock_stored_again_are_one_attempts_message() -> None:
    # One attempt, acked once: the broker went down with its ack unsent, the producer
    # retried the batch and librdkafka's mock stored it again (a broker would not). The
    # copies are the same batch: one partition, one producer timestamp.
    findings = check({(0, 0): "k", (0, 1): "k"}, [done("k", 1, 0, 1)], {"k": 1},
                     [("k", 1, "ok", 1, "done")], stamps={(0, 0): 1000, (0, 1): 1000})
    assert sum(findings.counts.values()) == 0, findings.violations
    assert findings.kafka["keys_per_count"] == {"2": 1}
    assert findings.kafka["stored_again"] == 1


@pytest.mark.parametrize("stamps", [{(0, 0): 1000, (0, 1): 1001},   # handed over apart
                                    {(0, 0): 1000, (1, 0): 1000}])  # another partition
def test_copies_that_are_not_one_batch_are_still_repeats_to_explain(
    stamps: dict[tuple[int, int], int]
) -> None:
    at = dict.fromkeys(stamps, "k")
    last = max(at)
    findings = check(at, [done("k", 1, *last)], {"k": 1}, [("k", 1, "ok", 1, "done")],
                     stamps=stamps)
    assert findings.counts["kafka_unexplained_repeats"] == 1, findings.violations
    assert findings.kafka["stored_again"] == 0


def test_the_topic_read_counts_the_copies_of_one_batch_once(tmp_path: Path) -> None:
    # Three messages of "k": two with one producer timestamp (a batch stored twice),
    # one stamped apart (another attempt); "j" once.
    kafka = ChaosKafka(tmp_path)
    try:
        producer = Producer({"bootstrap.servers": kafka.bootstrap_servers, "log_level": 0})
        for key, stamp in (("k", 1000), ("k", 1000), ("k", 1001), ("j", 1000)):
            producer.produce(TOPIC, b"{}", key=b"o", timestamp=stamp,
                             headers=[("outbox-key", key.encode())])
        assert producer.flush(10) == 0
        assert kafka.messages_per_key() == {"k": 3, "j": 1}
        assert kafka.produced_per_key() == {"k": 2, "j": 1}
    finally:
        kafka.close()


def test_a_key_handled_twice_or_never_is_flagged() -> None:
    findings = check({(0, 0): "a", (1, 0): "b"}, [done("a", 1, 0, 0), done("b", 1, 1, 0)],
                     {"a": 2}, [("a", 1, "ok", 1, "done"), ("b", 1, "ok", 1, "done")])
    assert findings.counts["consumed_not_once"] == 2


def test_a_ledger_naming_another_message_is_flagged() -> None:
    findings = check({(0, 0): "a", (0, 1): "b"}, [done("a", 1, 0, 1), done("b", 1, 3, None)],
                     {"a": 1, "b": 1}, [("a", 1, "ok", 1, "done"), ("b", 1, "ok", 1, "done")])
    assert findings.counts["ledger_result_mismatch"] == 2
