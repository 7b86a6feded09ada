"""Fixtures for the adapter tests: fakes that check the API key, adapters pointed at them.

No database: jobs are built by hand and ``perform`` is called directly.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from effects import ChargeCard, PostWebhook, RefundPayment, SendEmail
from effects.testing import FakeEmailProvider, FakeStripe, FakeWebhookReceiver

from ._support import RESEND_KEY, SHORT_TIMEOUT, STRIPE_KEY, TIMEOUT, WEBHOOK_SECRET


@pytest.fixture(autouse=True)
def no_thread_leak() -> Iterator[None]:
    """Every fake and helper thread a test starts is gone when it ends."""
    before = set(threading.enumerate())
    yield
    leaked = [thread.name for thread in threading.enumerate() if thread not in before]
    assert not leaked, f"threads left running: {leaked}"


@pytest.fixture
def refused_url() -> str:
    """A loopback URL where nothing listens: connecting is refused at once."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def resend() -> Iterator[FakeEmailProvider]:
    with FakeEmailProvider(api_key=RESEND_KEY) as fake:
        yield fake


@pytest.fixture
def send_email(resend: FakeEmailProvider) -> Iterator[SendEmail]:
    with SendEmail(api_key=RESEND_KEY, base_url=resend.url, timeout=TIMEOUT) as adapter:
        yield adapter


@pytest.fixture
def impatient_send_email(resend: FakeEmailProvider) -> Iterator[SendEmail]:
    with SendEmail(api_key=RESEND_KEY, base_url=resend.url, timeout=SHORT_TIMEOUT) as adapter:
        yield adapter


@pytest.fixture
def stripe_fake() -> Iterator[FakeStripe]:
    with FakeStripe(api_key=STRIPE_KEY) as fake:
        yield fake


@pytest.fixture
def charge_card(stripe_fake: FakeStripe) -> Iterator[ChargeCard]:
    with ChargeCard(api_key=STRIPE_KEY, base_url=stripe_fake.url, timeout=TIMEOUT) as adapter:
        yield adapter


@pytest.fixture
def impatient_charge_card(stripe_fake: FakeStripe) -> Iterator[ChargeCard]:
    with ChargeCard(STRIPE_KEY, base_url=stripe_fake.url, timeout=SHORT_TIMEOUT) as adapter:
        yield adapter


@pytest.fixture
def refund_payment(stripe_fake: FakeStripe) -> Iterator[RefundPayment]:
    with RefundPayment(api_key=STRIPE_KEY, base_url=stripe_fake.url, timeout=TIMEOUT) as adapter:
        yield adapter


@pytest.fixture
def receiver() -> Iterator[FakeWebhookReceiver]:
    with FakeWebhookReceiver(WEBHOOK_SECRET) as fake:
        yield fake


@pytest.fixture
def post_webhook(receiver: FakeWebhookReceiver) -> Iterator[PostWebhook]:
    with PostWebhook(url=receiver.url, secret=WEBHOOK_SECRET, timeout=TIMEOUT) as adapter:
        yield adapter


@pytest.fixture
def impatient_post_webhook(receiver: FakeWebhookReceiver) -> Iterator[PostWebhook]:
    with PostWebhook(receiver.url, WEBHOOK_SECRET, timeout=SHORT_TIMEOUT) as adapter:
        yield adapter
