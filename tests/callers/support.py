"""Helpers of the tests of callers that are not Python: the SQL function, called as psql
or a driver of another language calls it."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from outbox import Effect, Job


def sql_enqueue(conn: psycopg.Connection[Any], schema: str, effect: str | None,
                key: str | None, payload: Any, **named: Any) -> int | None:
    """``SELECT <schema>.enqueue(effect, key, payload, name => value, ...)`` on ``conn``
    (in its transaction). ``payload`` is a dict (sent as jsonb), JSON text, or None."""
    value = Jsonb(payload) if isinstance(payload, dict) else payload
    arguments = [sql.SQL("%s"), sql.SQL("%s"), sql.SQL("CAST(%s AS jsonb)")] + [
        sql.SQL("{} => %s").format(sql.Identifier(name)) for name in named]
    query = sql.SQL("SELECT {}.enqueue({})").format(
        sql.Identifier(schema), sql.SQL(", ").join(arguments))
    row = conn.execute(query, (effect, key, value, *named.values())).fetchone()
    assert row is not None
    found: int | None = row[0]
    return found


class Recorder(Effect):
    """Counts its performs per key."""

    name = "test.record"

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.lock = threading.Lock()

    def perform(self, job: Job) -> dict[str, Any]:
        with self.lock:
            self.calls[job.key] += 1
        return {"key": job.key}
