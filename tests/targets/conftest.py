"""The many-databases tests' fixtures: databases of their own, dropped after the test;
the dispatcher's threads started and connections opened, counted."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from .support import Databases, Started


@pytest.fixture
def databases(dsn: str) -> Iterator[Databases]:
    made = Databases(dsn)
    try:
        yield made
    finally:
        made.drop()


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> Iterator[Started]:
    counts = Started()
    start = threading.Thread.start
    connect = psycopg.connect

    def counted_start(thread: threading.Thread) -> None:
        if thread.name.startswith("outbox"):
            with counts.lock:
                counts.threads += 1
        start(thread)

    def counted_connect(*args: Any, **kwargs: Any) -> Any:
        if str(kwargs.get("application_name", "")).startswith("outbox"):
            with counts.lock:
                counts.connections += 1
        return connect(*args, **kwargs)

    monkeypatch.setattr(threading.Thread, "start", counted_start)
    monkeypatch.setattr(psycopg, "connect", counted_connect)
    yield counts
