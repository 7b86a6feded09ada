"""Small helpers shared by the integration tests."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import sql

import outbox
from outbox import Dispatcher


def table(schema: str, name: str) -> sql.Composed:
    """``schema.name`` as quoted identifiers."""
    return sql.SQL("{}.{}").format(sql.Identifier(schema), sql.Identifier(name))


def fetch(
    dsn: str, query: sql.Composed | sql.SQL | str, params: Any = None
) -> list[tuple[Any, ...]]:
    """Run one query on a fresh autocommit connection and return all rows."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(query, params).fetchall()


def wait_until(predicate: Callable[[], bool], timeout: float = 20.0, what: str = "") -> None:
    """Poll ``predicate`` until true; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        time.sleep(0.02)


@contextmanager
def running(dispatcher: Dispatcher) -> Iterator[None]:
    """``dispatcher.run()`` on a thread for the block; stopped and joined after it."""
    thread = threading.Thread(target=dispatcher.run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        dispatcher.stop()
        thread.join(30)
        assert not thread.is_alive()


def wait_for_listener(dsn: str) -> None:
    """Wait until a dispatcher's listener is LISTENing (a notification reaches it)."""
    wait_until(lambda: bool(fetch(dsn, "SELECT 1 FROM pg_stat_activity "
                                       "WHERE application_name LIKE 'outbox listener %%' "
                                       "AND query LIKE 'LISTEN%%'")), what="listener")


@contextmanager
def schema_at(dsn: str, version: int, prefix: str) -> Iterator[str]:
    """A schema of its own (``prefix`` and a random suffix) migrated up to ``version``, as
    a release that knew no later migration left it; dropped after the block."""
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        outbox.migrate(conn, schema=name, target=version)
    try:
        yield name
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                sql.Identifier(name)))
