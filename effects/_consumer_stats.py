"""The counters both inbox consumers (NATS JetStream and Kafka) report for a run."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ConsumerStats"]


@dataclass
class ConsumerStats:
    """Counters of one run: messages handled, skipped as repeats, failed, and parked on
    the dead-letter subject or topic."""

    handled: int = 0
    duplicates: int = 0
    failed: int = 0
    dead_lettered: int = 0
    errors: list[str] = field(default_factory=list)
