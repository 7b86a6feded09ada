"""The loops' instructions on a real database, under both drivers alike: a step in one
transaction (``Transaction``) commits when it returns and rolls back when it raises."""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from outbox import Effect, Job
from outbox._dispatch.connection import AsyncConnection, Connection, connect
from outbox._dispatch.runtime import Program, Transaction, drive, drive_async
from outbox._dispatch.settings import Settings
from outbox._steps import Statement


class Noop(Effect):
    name = "test.noop"

    def perform(self, job: Job) -> None:
        return None


def insert(schema: str, value: int, *, then_fail: bool) -> Generator[Statement, Any, int]:
    """Two statements in the transaction, then (maybe) an error."""
    table = f'"{schema}".runtime_probe'
    yield Statement(f"INSERT INTO {table} (n) VALUES (%(n)s)", {"n": value})
    [(count,)] = yield Statement(f"SELECT count(*) FROM {table}", {})
    if then_fail:
        raise ValueError("the step refused")
    return int(count)


def writes(schema: str, conn: Any) -> Program[list[Any]]:
    """Commit one row, then try another whose step raises: answered, not raised."""
    seen: list[Any] = [(yield Transaction(insert(schema, 1, then_fail=False), conn))]
    try:
        yield Transaction(insert(schema, 2, then_fail=True), conn)
    except ValueError as exc:
        seen.append(str(exc))
    return seen


def rows(dsn: str, schema: str) -> list[int]:
    with psycopg.connect(dsn) as pg:
        query = sql.SQL("SELECT n FROM {}.runtime_probe ORDER BY n").format(
            sql.Identifier(schema))
        return [n for n, in pg.execute(query)]


@pytest.mark.parametrize("flavour", ["blocking", "asyncio"])
def test_a_transaction_commits_a_step_that_returns_and_rolls_back_one_that_raises(
        dsn: str, schema: str, flavour: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as pg:
        pg.execute(sql.SQL("CREATE TABLE {}.runtime_probe (n int)").format(
            sql.Identifier(schema)))
    settings = Settings.build(dsn, [Noop()], schema=schema)
    if flavour == "blocking":
        conn = Connection(lambda role: connect(settings, role), "claimer")
        try:
            seen = drive(writes(schema, conn))
        finally:
            conn.discard()
    else:
        async def main() -> list[Any]:
            aconn = AsyncConnection(settings, "claimer")
            try:
                return await drive_async(writes(schema, aconn))
            finally:
                await aconn.discard()

        seen = asyncio.run(main())
    # The first step saw its own row; the second's row went with its transaction.
    assert seen == [1, "the step refused"]
    assert rows(dsn, schema) == [1]
