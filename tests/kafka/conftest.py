"""A mock Kafka cluster for the session, held by a process of its own."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from effects.testing import KafkaMockCluster


@pytest.fixture(scope="session")
def kafka() -> Iterator[KafkaMockCluster]:
    with KafkaMockCluster() as cluster:
        yield cluster


@pytest.fixture
def topic() -> str:
    """A topic of its own per test (the mock cluster creates it on first use)."""
    return f"t-{uuid.uuid4().hex[:10]}"
