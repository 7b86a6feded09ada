"""The queue as operators read it: jobs per status and effect, and each effect's health.

One reading for every surface that reports the queue (the dashboard's overview, the
Prometheus database collector), so they count alike and say "due" alike:

- counts are exact on a small table; on a large one the unfinished states are counted
  exactly and done jobs (history) estimated from a block sample;
- "due" applies the claim's own rules (``sql/queue.sql``, block ``effect_health``): a
  job held back by its ordering key waits for its key-mate, not for a dispatcher, so it
  is neither due nor part of the oldest due age.

The reading is a step (``outbox._steps``): the same statements and the same
interpretation of their rows, driven on a blocking connection (``read``) or an asyncio
one (``read_async``). Callers bound the transaction (read-only, statement timeout).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import psycopg

from ._sql import BoundQueries, bind_schema, check_schema_name, parse_blocks
from ._steps import Rows, Statement, Step, run, run_async

__all__ = [
    "EXACT_COUNT_LIMIT",
    "SAMPLE_ROWS",
    "STATUSES",
    "Counts",
    "EffectHealth",
    "QueueQueries",
    "Snapshot",
    "exact",
    "queue_queries",
    "read",
    "read_async",
    "sample_percent",
    "snapshot",
    "with_done_estimated",
]

STATUSES = ("pending", "running", "done", "failed", "reconcile")
EXACT_COUNT_LIMIT = 200_000
"""Below this many rows (the planner's estimate), every status is counted exactly."""
SAMPLE_ROWS = 20_000
"""Rows a block sample should see when done jobs are estimated."""

CountMap = dict[tuple[str, str], int]


def exact(estimate: int) -> bool:
    """Whether a table of about ``estimate`` rows is small enough to count exactly."""
    return estimate < EXACT_COUNT_LIMIT


def sample_percent(estimate: int) -> float:
    """The TABLESAMPLE percentage that sees about ``SAMPLE_ROWS`` rows."""
    return min(100.0, 100.0 * SAMPLE_ROWS / max(estimate, 1))


def with_done_estimated(unfinished: Iterable[tuple[str, str, int]],
                        sample: Iterable[tuple[str, int]], estimate: int) -> CountMap:
    """Exact counts of the unfinished states plus done jobs estimated: the table's row
    estimate less the unfinished jobs, split by effect as in the sample."""
    counts = {(status, effect): int(n) for status, effect, n in unfinished}
    sampled = {effect: int(n) for effect, n in sample}
    done_total = max(0, estimate - sum(counts.values()))
    seen = sum(sampled.values())
    for effect, n in sampled.items():
        counts[("done", effect)] = round(done_total * n / seen)
    return counts


@dataclass(frozen=True)
class Counts:
    """Jobs per (status, effect); ``estimated`` when done jobs were sampled."""

    counts: CountMap
    estimated: bool
    dead_tuples: int

    def total(self, status: str) -> int:
        """All jobs of ``status``."""
        return sum(n for (s, _), n in self.counts.items() if s == status)

    def get(self, status: str, effect: str) -> int:
        """Jobs of ``status`` and ``effect``."""
        return self.counts.get((status, effect), 0)


@dataclass(frozen=True, slots=True)
class EffectHealth:
    """One effect's health. Ages in seconds, None when there is no such job; a job held
    back by its ordering key is not due (the claim would not take it)."""

    effect: str
    oldest_due_age: float | None
    expired_leases: int
    oldest_reconcile_age: float | None


@dataclass(frozen=True)
class Snapshot:
    """The counts and, per effect with unfinished jobs, the health."""

    counts: Counts
    health: dict[str, EffectHealth]

    def effects(self) -> set[str]:
        """Every effect the reading saw."""
        return {effect for _, effect in self.counts.counts} | set(self.health)


class QueueQueries(BoundQueries):
    """The statements of ``sql/queue.sql`` for one schema; attribute access by name."""

    def __init__(self, schema: str) -> None:
        self.schema = check_schema_name(schema)
        super().__init__({name: bind_schema(body, schema) for name, body in _raw().items()},
                         "sql/queue.sql")


@cache
def _raw() -> dict[str, str]:
    text = resources.files("outbox").joinpath("sql/queue.sql").read_text("utf-8")
    return parse_blocks(text)


@cache
def queue_queries(schema: str) -> QueueQueries:
    """The statements for ``schema``, composed once per schema and process."""
    return QueueQueries(schema)


def snapshot(schema: str) -> Step[Snapshot]:
    """Read the counts and the health: four statements at most, none a full scan of
    the done history on a large table."""
    q = queue_queries(schema)
    size = yield Statement(q.table_size, {"schema_name": schema})
    estimate, dead = (int(size[0][0]), int(size[0][1])) if size else (0, 0)
    if exact(estimate):
        found = yield Statement(q.counts_exact, {})
        counts = Counts({(s, e): int(n) for s, e, n in found}, False, dead)
    else:
        unfinished = yield Statement(q.counts_unfinished, {})
        sample = yield Statement(q.done_sample, {"percent": sample_percent(estimate)})
        counts = Counts(with_done_estimated(unfinished, sample, estimate), True, dead)
    health = yield Statement(q.effect_health, {})
    return Snapshot(counts, {row[0]: EffectHealth(row[0], row[1], int(row[2]), row[3])
                             for row in health})


def read(conn: psycopg.Connection[Any], schema: str) -> Snapshot:
    """``snapshot`` on a blocking connection, inside the caller's transaction."""

    def execute(statement: Statement) -> Rows:
        return conn.execute(statement.query, statement.params).fetchall()

    return run(snapshot(schema), execute)


async def read_async(conn: psycopg.AsyncConnection[Any], schema: str) -> Snapshot:
    """``snapshot`` on an asyncio connection, inside the caller's transaction."""

    async def execute(statement: Statement) -> Rows:
        cur = await conn.execute(statement.query, statement.params)
        return await cur.fetchall()

    return await run_async(snapshot(schema), execute)
