"""Small helpers shared by the integration tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql


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
