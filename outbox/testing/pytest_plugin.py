"""pytest fixtures for a real PostgreSQL (registered through the ``pytest11`` entry point).

``outbox_dsn`` (session): the connection string of ``$OUTBOX_TEST_DSN`` when set, else of
an embedded PostgreSQL started on first use and stopped at the end of the session.
``outbox_schema``: a freshly migrated schema of the test's own (dropped afterwards), so
tests may commit, LISTEN and run dispatcher processes without seeing each other's rows.
Nothing starts unless a test asks for a fixture.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

__all__ = ["outbox_dsn", "outbox_schema"]

# Headroom for tests that run several dispatcher processes at once (each holds a few
# connections); the stock 100 runs out.
SERVER_SETTINGS = {"max_connections": "300"}


@pytest.fixture(scope="session")
def outbox_dsn() -> Iterator[str]:
    """Connection string of the PostgreSQL server the tests use (one per session)."""
    configured = os.environ.get("OUTBOX_TEST_DSN")
    if configured:
        yield configured
        return
    from outbox.testing import start_server

    with start_server(settings=SERVER_SETTINGS) as server:
        yield server.dsn


@pytest.fixture
def outbox_schema(outbox_dsn: str) -> Iterator[str]:
    """The name of a freshly migrated schema for this test alone, dropped afterwards."""
    from outbox.testing import create_schema, drop_schema

    name = create_schema(outbox_dsn)
    yield name
    drop_schema(outbox_dsn, name)
