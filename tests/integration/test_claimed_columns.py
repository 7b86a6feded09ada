"""The claim's rows are read by position (``claimer.CLAIMED``): here, on PostgreSQL, the
statements answer exactly those columns (the core claim, and the limited claim, whose
rows start with them), and a statement answering others is refused by name on both
drivers rather than read three places off."""

from __future__ import annotations

import asyncio

import psycopg
import pytest

import outbox
from outbox._dispatch.claimer import CLAIMED
from outbox._steps import ColumnsChanged, Statement, execute, execute_async
from outbox.sql import queries

CLAIM = {"limit": 10, "lease": 60.0, "worker": "w", "after": "{}"}


def _enqueue(conn: psycopg.Connection[object], schema: str, key: str) -> None:
    with outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue("test.columns", key=key, payload={"n": 1})


def test_the_claim_answers_the_columns_its_reader_reads(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        _enqueue(conn, schema, "k1")
        _enqueue(conn, schema, "k2")
        core = queries(schema)
        cursor = conn.execute(core.claim, {**CLAIM, "limit": 1, "effects": ["test.columns"]})
        assert tuple(c.name for c in cursor.description or ()) == CLAIMED
        [row] = execute(conn, Statement(core.claim, {**CLAIM, "effects": ["test.columns"]},
                                        columns=CLAIMED))
        assert type(row) is tuple and row[CLAIMED.index("key")] == "k2"
        # The limited claim answers c.* of the same UPDATE, then its own columns.
        _enqueue(conn, schema, "k3")
        limited = conn.execute(core.limit_claim, {
            **CLAIM, "effect": "test.columns", "rate": None, "burst": None,
            "concurrency": None, "group_rate": None, "group_burst": None,
            "group_concurrency": None})
        names = tuple(c.name for c in limited.description or ())
        assert names[:len(CLAIMED)] == CLAIMED
        assert [r[CLAIMED.index("key")] for r in limited.fetchall()] == ["k3"]


def test_other_columns_than_named_are_refused_on_both_drivers(dsn: str) -> None:
    good = Statement("SELECT 1 AS id, 'k' AS key", {}, columns=("id", "key"))
    swapped = Statement("SELECT 'k' AS key, 1 AS id", {}, columns=("id", "key"))
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert execute(conn, good) == [(1, "k")]
        with pytest.raises(ColumnsChanged, match=r"\['key', 'id'\]"):
            execute(conn, swapped)

    async def on_asyncio() -> None:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            assert await execute_async(conn, good) == [(1, "k")]
            with pytest.raises(ColumnsChanged):
                await execute_async(conn, swapped)

    asyncio.run(on_asyncio())
