"""Fixtures for the NATS tests: a stream of its own per test on the session's server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from effects.nats import PublishEvent
from effects.testing import NatsServer

from .support import add_stream, delete_stream


@pytest.fixture
def stream(nats_server: NatsServer) -> Iterator[str]:
    """A fresh limits stream capturing ``<name>.>`` with a 2-minute duplicate window."""
    name = add_stream(nats_server.url, duplicate_window=120.0)
    yield name
    if nats_server.running:
        delete_stream(nats_server.url, name)


@pytest.fixture
def publisher(nats_server: NatsServer, stream: str) -> Iterator[PublishEvent]:
    """A ``PublishEvent`` on ``stream``, closed after the test."""
    with PublishEvent(nats_server.url, stream, timeout=2.0) as effect:
        yield effect
