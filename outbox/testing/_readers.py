"""Readers of the outbox tables for tests, over the product's own named queries."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from functools import cache
from typing import Any

import psycopg
from psycopg.rows import dict_row

from .._enqueue import canonical_json
from .._sql import BoundQueries, bind_file

__all__ = ["NotEnqueued", "audit", "job", "jobs", "ledger", "ledger_row", "received",
           "require_enqueued"]

@cache
def queries(schema: str) -> BoundQueries:
    """The test kit's statements (``testing/queries.sql``) for ``schema``, bound once."""
    return BoundQueries(bind_file("outbox.testing", "queries.sql", schema),
                        "testing/queries.sql")


# What a reader reads through: a psycopg connection, or a connection string to open one
# (in autocommit) for the call.
Connectable = psycopg.Connection[Any] | str


@contextmanager
def _connection(conn: Connectable) -> Iterator[psycopg.Connection[Any]]:
    if isinstance(conn, str):
        with psycopg.connect(conn, autocommit=True) as own:
            yield own
    else:
        yield conn


def _rows(conn: Connectable, query: str, params: Mapping[str, Any]) -> list[dict[str, Any]]:
    with _connection(conn) as c, c.cursor(row_factory=dict_row) as cur:
        cur.execute(query.encode(), params)
        return cur.fetchall()


def jobs(conn: Connectable, schema: str = "outbox", *, effect: str | None = None,
         key: str | None = None) -> dict[str, dict[str, Any]]:
    """The jobs by key, oldest first, as dicts of their columns; only those of ``effect``
    and ``key`` when given (a key names at most one job)."""
    rows = _rows(conn, queries(schema).testkit_jobs, {"effect": effect, "key": key})
    return {row["key"]: row for row in rows}


def job(conn: Connectable, key: str, schema: str = "outbox") -> dict[str, Any] | None:
    """The job holding ``key``, as a dict of its columns, or None."""
    return jobs(conn, schema, key=key).get(key)


def ledger(conn: Connectable, schema: str = "outbox") -> dict[str, dict[str, Any]]:
    """Every ledger row (``effect_results``) by key, as dicts of their columns."""
    rows = _rows(conn, queries(schema).testkit_ledger, {"key": None})
    return {row["key"]: row for row in rows}


def ledger_row(conn: Connectable, key: str, schema: str = "outbox") -> dict[str, Any] | None:
    """The ledger row for ``key`` (the recorded result of a completed effect), or None."""
    rows = _rows(conn, queries(schema).testkit_ledger, {"key": key})
    return rows[0] if rows else None


def audit(conn: Connectable, schema: str = "outbox", *,
          actor: str | None = None) -> list[dict[str, Any]]:
    """The audit trail (``dashboard_audit``: operators' actions from the dashboard or the
    command line, the reconciler's decisions), oldest first, as dicts of their columns;
    only ``actor``'s when given (``"reconciler"`` for the reconciler's)."""
    return _rows(conn, queries(schema).testkit_audit, {"actor": actor})


def received(conn: Connectable, consumer: str, schema: str = "outbox") -> list[str]:
    """The message ids ``consumer`` received through ``tx.receive`` (its inbox rows),
    in the order received (by transaction): each id once, however often delivered."""
    rows = _rows(conn, queries(schema).testkit_inbox, {"consumer": consumer})
    return [str(row["message_id"]) for row in rows]


class NotEnqueued(AssertionError):
    """``require_enqueued`` found no job as described; the message says what differs."""


def require_enqueued(
    conn: Connectable,
    effect: str,
    *,
    key: str | None = None,
    payload: Mapping[str, Any] | Any | None = None,
    schema: str = "outbox",
) -> dict[str, Any]:
    """Assert that a job of ``effect`` is enqueued; return its row.

    With ``key``, the job holding that key must be of ``effect``; without it, exactly one
    job of ``effect`` must match. With ``payload`` (a mapping or a pydantic model,
    compared as enqueue stores it), the job's payload must equal it. Raises
    ``NotEnqueued`` (an ``AssertionError``) naming what was found instead: another
    effect under the key, the payload fields that differ, or the jobs that exist.
    """
    expected = None if payload is None else json.loads(canonical_json(payload))
    candidates = list(jobs(conn, schema, effect=effect, key=key).values())
    what = f"{effect!r} job" + (f" with key {key!r}" if key is not None else "")
    if not candidates:
        raise NotEnqueued(f"no {what} in schema {schema!r}; {_inventory(conn, schema)}")
    matching = [c for c in candidates if expected is None or c["payload"] == expected]
    if len(matching) == 1:
        return matching[0]
    if matching:
        keys = ", ".join(repr(c["key"]) for c in matching[:5])
        raise NotEnqueued(f"{len(matching)} {what}s match in schema {schema!r} ({keys}); "
                          "pass key= to say which")
    differences = "; ".join(
        f"key {c['key']!r}: " + ", ".join(_differences(expected, c["payload"]))
        for c in candidates[:3]
    )
    raise NotEnqueued(f"{what} has another payload in schema {schema!r}: {differences}")


def _inventory(conn: Connectable, schema: str, most: int = 5) -> str:
    found = list(jobs(conn, schema).values())
    if not found:
        return "the schema has no jobs"
    listed = ", ".join(f"{j['effect']} {j['key']!r}" for j in found[:most])
    more = f" and {len(found) - most} more" if len(found) > most else ""
    return f"jobs there: {listed}{more}"


def _differences(expected: Any, found: Any, path: str = "payload") -> list[str]:
    """Where two JSON values differ, as short phrases (path: expected, found)."""
    if isinstance(expected, dict) and isinstance(found, dict):
        out: list[str] = []
        for name in sorted(expected.keys() | found.keys()):
            where = f"{path}[{name!r}]"
            if name not in found:
                out.append(f"{where} missing")
            elif name not in expected:
                out.append(f"{where} not expected (found {found[name]!r})")
            else:
                out.extend(_differences(expected[name], found[name], where))
        return out
    if isinstance(expected, list) and isinstance(found, list) and len(expected) == len(found):
        return [d for i, (e, f) in enumerate(zip(expected, found, strict=True))
                for d in _differences(e, f, f"{path}[{i}]")]
    if expected == found:
        return []
    return [f"{path} expected {expected!r}, found {found!r}"]
