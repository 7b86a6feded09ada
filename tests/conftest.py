"""Shared fixtures: one real PostgreSQL for the session, a fresh schema per test.

``dsn`` and ``schema`` are the test kit's ``outbox_dsn`` and ``outbox_schema``
(``outbox.testing``, a pytest plugin): ``$OUTBOX_TEST_DSN`` when set, else an embedded
PostgreSQL for the session; each test's schema is migrated and dropped afterwards, so
tests may commit, LISTEN and run dispatcher processes without seeing each other's rows.
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest


@pytest.fixture(scope="session")
def dsn(outbox_dsn: str) -> str:
    """Connection string of the PostgreSQL server the tests use."""
    return outbox_dsn


@pytest.fixture
def schema(outbox_schema: str) -> str:
    """A freshly migrated schema of its own for this test, dropped afterwards."""
    return outbox_schema


@pytest.fixture
def conn(dsn: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    """A plain connection (not autocommit), closed after the test."""
    with psycopg.connect(dsn) as connection:
        yield connection
