"""How a step is answered its rows on PostgreSQL: tuples by default, records filled by
column name with ``row``, single values with ``scalar``; whatever row factory the
caller's connection has, on both drivers."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.rows import dict_row

from outbox._steps import Rows, Statement, Step, execute, execute_async, run, run_async

QUERY = "SELECT n AS id, 'k' || n AS key FROM generate_series(1, 3) AS n ORDER BY n"


@dataclass(frozen=True, slots=True)
class Keyed:
    key: str  # declared out of column order: filled by name, not position
    id: int


def reads() -> Step[tuple[Rows, Rows, Rows]]:
    plain = yield Statement(QUERY, {})
    named = yield Statement(QUERY, {}, row=Keyed)
    ids = yield Statement("SELECT n AS id FROM generate_series(1, 3) AS n ORDER BY n", {},
                          scalar=True)
    return plain, named, ids


EXPECTED = ([(1, "k1"), (2, "k2"), (3, "k3")],
            [Keyed("k1", 1), Keyed("k2", 2), Keyed("k3", 3)],
            [1, 2, 3])


def test_rows_as_tuples_records_or_values_on_a_blocking_connection(dsn: str) -> None:
    # A caller's connection with another row factory changes nothing a step is sent.
    with psycopg.connect(dsn, row_factory=dict_row) as conn:
        assert run(reads(), lambda statement: execute(conn, statement)) == EXPECTED


def test_rows_as_tuples_records_or_values_on_an_asyncio_connection(dsn: str) -> None:
    async def main() -> Any:
        async with await psycopg.AsyncConnection.connect(dsn, row_factory=dict_row) as conn:
            return await run_async(reads(), lambda statement: execute_async(conn, statement))

    assert asyncio.run(main()) == EXPECTED
