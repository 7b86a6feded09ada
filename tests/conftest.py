"""Shared fixtures: one real PostgreSQL for the session, a fresh schema per test.

Tests run against ``OUTBOX_TEST_DSN`` when it is set, else against an embedded
PostgreSQL started for the session. Each test gets its own schema (migrated, dropped
afterwards), so tests may commit, LISTEN and run dispatcher processes without seeing
each other's rows.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

import outbox
from outbox._embedded import restart_server, start_server


@pytest.fixture(scope="session")
def dsn() -> Iterator[str]:
    """Connection string of the PostgreSQL server the tests use."""
    configured = os.environ.get("OUTBOX_TEST_DSN")
    if configured:
        yield configured
        return
    data_dir = Path(tempfile.mkdtemp(prefix="outbox-test-pg-"))
    server = start_server(data_dir / "data")
    uri: str = server.get_uri()
    with psycopg.connect(uri, autocommit=True) as conn:
        # Headroom for the tests that start several dispatcher processes at once.
        conn.execute("ALTER SYSTEM SET max_connections = 300")
    restart_server(server)
    yield uri


@pytest.fixture
def schema(dsn: str) -> Iterator[str]:
    """A freshly migrated schema of its own for this test, dropped afterwards."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        outbox.migrate(conn, schema=name)
    yield name
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(name)))


@pytest.fixture
def conn(dsn: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    """A plain connection (not autocommit), closed after the test."""
    with psycopg.connect(dsn) as connection:
        yield connection
