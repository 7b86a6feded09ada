"""The fake providers of a chaos run, its NATS broker and its Kafka cluster."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from effects.testing import FakeEmailProvider, FakeProvider, FakeStripe, FakeWebhookReceiver

from .broker import ChaosBroker
from .kafka import ChaosKafka
from .schedule import EFFECTS

__all__ = ["WEBHOOK_SECRET", "Providers", "start_providers"]

WEBHOOK_SECRET = "whsec_Y2hhb3M="  # base64 of "chaos"


class Performer(Protocol):
    """What the checks ask of a provider: how often it performed a key."""

    def performed(self, key: str) -> int: ...

    def performed_keys(self) -> list[str]: ...


@dataclass
class Providers:
    """Resend, Stripe and a webhook receiver, each a local HTTP server that counts what
    it performed per idempotency key, a NATS broker whose stream counts messages per
    job key, and a Kafka cluster whose topic does too."""

    email: FakeEmailProvider
    stripe: FakeStripe
    webhook: FakeWebhookReceiver
    latency: float
    broker: ChaosBroker
    kafka: ChaosKafka

    def by_name(self, name: str) -> FakeProvider:
        """The fake called ``email``, ``stripe`` or ``webhook``."""
        fakes: dict[str, FakeProvider] = {"email": self.email, "stripe": self.stripe,
                                          "webhook": self.webhook}
        return fakes[name]

    def for_effect(self, effect: str) -> Performer:
        """The fake (or the broker) that performs ``effect``."""
        name = EFFECTS[effect]
        if name == "nats":
            return self.broker
        return self.kafka if name == "kafka" else self.by_name(name)

    def items(self) -> list[tuple[str, FakeProvider]]:
        """(name, fake) pairs."""
        return [(name, self.by_name(name)) for name in ("email", "stripe", "webhook")]

    def stalled_answers(self, upper: int) -> int:
        """Answers the fakes performed and then withheld (``succeed_then_timeout``), up
        to ``upper``, found through the fakes' public ``wait_for_stalls``."""
        return sum(_stalled(fake, upper) for _, fake in self.items())

    def close(self) -> None:
        """Release stalled answers and stop every server (joins their threads)."""
        for _, fake in self.items():
            fake.close()
        try:
            self.broker.close()
        finally:
            self.kafka.close()


def start_providers(latency: float, max_stall: float, retention: float,
                    log_dir: Path) -> Providers:
    """Start the three fakes with a base ``latency`` per request; an answer stalled by
    ``succeed_then_timeout`` is held at most ``max_stall`` seconds; a key is remembered
    ``retention`` seconds. The brokers too (the Kafka consumer logs to ``log_dir``)."""
    email = FakeEmailProvider(latency=latency, max_stall=max_stall, retention=retention)
    try:
        stripe = FakeStripe(latency=latency, max_stall=max_stall, retention=retention)
    except BaseException:
        email.close()
        raise
    try:
        webhook = FakeWebhookReceiver(WEBHOOK_SECRET, latency=latency, max_stall=max_stall,
                                      retention=retention)
    except BaseException:
        email.close()
        stripe.close()
        raise
    try:
        broker = ChaosBroker()
    except BaseException:
        for fake in (email, stripe, webhook):
            fake.close()
        raise
    try:
        kafka = ChaosKafka(log_dir)
    except BaseException:
        for fake in (email, stripe, webhook):
            fake.close()
        broker.close()
        raise
    return Providers(email, stripe, webhook, latency, broker, kafka)


def _stalled(fake: FakeProvider, upper: int) -> int:
    count = 0
    for n in range(1, upper + 1):
        try:
            fake.wait_for_stalls(n, timeout=0)
        except AssertionError:
            break
        count = n
    return count
