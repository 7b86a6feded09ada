"""Fixtures of the crash tests: an observer connection, the table provider, workers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .provider import Conn, Provider, TableEffect, create_tables
from .support import Workers, connect


@pytest.fixture
def db(dsn: str) -> Iterator[Conn]:
    """An autocommit connection the test observes and steers with."""
    with connect(dsn) as conn:
        yield conn


@pytest.fixture
def provider(db: Conn, schema: str) -> Provider:
    """The table provider, created in the test's schema."""
    create_tables(db, schema)
    return Provider(db, schema)


@pytest.fixture
def effect(dsn: str, schema: str) -> Iterator[TableEffect]:
    """The table effect for in-process dispatchers; its connections close afterwards."""
    instance = TableEffect(dsn, schema)
    yield instance
    instance.close()


@pytest.fixture
def workers(dsn: str, schema: str, tmp_path: Path) -> Iterator[Workers]:
    """Starts worker subprocesses; every one still alive is killed when the test ends
    (before its schema is dropped, since this fixture depends on ``schema``)."""
    started = Workers(dsn, schema, tmp_path)
    yield started
    started.cleanup()
