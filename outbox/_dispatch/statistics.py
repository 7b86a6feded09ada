"""The queue tables' first statistics, taken as soon as they hold rows.

A prepared statement keeps the generic plan it was given until the statistics of a table
it reads change. A business connection that enqueued a few times while the tables were
new keeps a plan made for empty tables (a scan of the whole ledger per enqueue) until
autovacuum's first ANALYZE, which comes up to ``autovacuum_naptime`` (a minute by
default) after the load began: measured, an enqueue of 10 jobs took 13.7 ms against
1.6 ms once the ledger held 100,000 rows. So, until every queue table has been analyzed
once (by anyone), a dispatcher looks every ``CHECK_INTERVAL`` seconds and ANALYZEs a
table that has had ``ROWS`` changes and was never analyzed, once per table. Then it
never looks again. A role that may not ANALYZE (not the owner, no MAINTAIN: PostgreSQL
skips the table with a warning) leaves it to autovacuum.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import psycopg

from .._sql import bind_schema
from .._steps import Statement, Step
from .settings import Settings
from .signals import Timer

__all__ = ["CHECK_INTERVAL", "ROWS", "FirstStatistics"]

log = logging.getLogger("outbox.dispatcher")

CHECK_INTERVAL = 5.0
ROWS = 1000
TABLES = ("jobs", "effect_results", "inbox")


@dataclass
class FirstStatistics:
    """Analyzes the queue tables once each, as early as they hold rows (one part: the
    claimer's thread or task)."""

    settings: Settings
    timer: Timer = field(default_factory=lambda: Timer(CHECK_INTERVAL))
    done: bool = False
    tried: set[str] = field(default_factory=set)

    def due(self, now: float) -> bool:
        return not self.done and self.timer.due(now)

    def analyze(self) -> Step[None]:
        """ANALYZE the queue tables never analyzed that have ``ROWS`` changes; done once
        each of them has statistics."""
        schema = self.settings.schema
        rows = yield Statement(self.settings.queries.unanalyzed_tables,
                               {"schema_name": schema, "tables": list(TABLES), "rows": ROWS},
                               named=True)
        waiting = [table for table in rows if table.name not in self.tried]
        if not waiting:
            self.done = True
            return
        for table in waiting:
            if not table.ready or table.name not in TABLES:
                continue
            self.tried.add(table.name)
            try:
                yield Statement(bind_schema("ANALYZE {schema}." + table.name, schema), {},
                                count=True)
            except psycopg.errors.InsufficientPrivilege:
                log.info("the dispatcher's role may not ANALYZE %s.%s: its first statistics "
                         "come from autovacuum", schema, table.name)
