"""pytest fixtures for the fake providers (registered through the pytest11 entry point).

``fake_email``, ``fake_stripe`` and ``fake_webhook`` each yield a started fake provider
from ``effects.testing``, closed (threads joined) after the test; ``nats_server`` yields
a real NATS server with JetStream (``effects.testing.NatsServer``), one per session.
Everything is imported when a fixture is first used, so merely having this plugin
installed costs nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from effects.testing import FakeEmailProvider, FakeStripe, FakeWebhookReceiver, NatsServer

__all__ = ["fake_email", "fake_stripe", "fake_webhook", "nats_server"]


@pytest.fixture
def fake_email() -> Iterator[FakeEmailProvider]:
    """A local Resend (``FakeEmailProvider``) accepting any API key; use ``.url``."""
    from effects.testing import FakeEmailProvider

    with FakeEmailProvider() as fake:
        yield fake


@pytest.fixture
def fake_stripe() -> Iterator[FakeStripe]:
    """A local Stripe (``FakeStripe``) accepting any API key; use ``.url``."""
    from effects.testing import FakeStripe

    with FakeStripe() as fake:
        yield fake


@pytest.fixture
def fake_webhook() -> Iterator[FakeWebhookReceiver]:
    """A webhook receiver (``FakeWebhookReceiver``); post to ``.url``, sign with ``.secret``."""
    from effects.testing import FakeWebhookReceiver

    with FakeWebhookReceiver(secret="whsec_fake") as fake:
        yield fake


@pytest.fixture(scope="session")
def nats_server() -> Iterator[NatsServer]:
    """A ``nats-server -js`` on 127.0.0.1 for the session; connect to ``.url``.

    Shared by the tests of a session: give each test streams of its own.
    """
    from effects.testing import NatsServer

    with NatsServer() as server:
        yield server
