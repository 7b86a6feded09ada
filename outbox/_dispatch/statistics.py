"""Statistics for the queue tables while they are young, until autovacuum keeps them.

A plan is made from the statistics of the tables it reads, and a prepared statement keeps
its generic plan until they change. Statistics taken when a table was new describe a
table that is no more: a business connection that enqueued while the tables were empty
kept a plan scanning the whole ledger per enqueue (10 jobs: 13.7 ms against 1.6 ms
planned on 100,000 rows), and statistics taken at the first thousand jobs kept a soak at
4,000 jobs a second to 1,100 for its first 75 seconds, until autovacuum's first ANALYZE
(which comes up to ``autovacuum_naptime``, a minute by default, after the load began):
then 5,000. So, until autovacuum has analyzed a queue table once, a dispatcher looks
every ``CHECK_INTERVAL`` seconds and ANALYZEs it when it has had ``ROWS`` changes and
no statistics, or changes of twice the rows its statistics counted: a few times while
it grows (each ANALYZE reads a sample of bounded size), at most ``MOST_PER_TABLE`` times.
Then autovacuum's own thresholds (set by the migrations) take over and it never looks
again. A role that may not ANALYZE a table (not its owner nor a superuser) leaves it to
autovacuum.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import psycopg

from .._sql import bind_schema
from .._steps import Statement, Step
from .settings import Settings
from .signals import Timer

__all__ = ["CHECK_INTERVAL", "MOST_PER_TABLE", "ROWS", "FirstStatistics"]

log = logging.getLogger("outbox.dispatcher")

CHECK_INTERVAL = 5.0
ROWS = 1000
MOST_PER_TABLE = 20
TABLES = ("jobs", "effect_results", "inbox")


@dataclass
class FirstStatistics:
    """Keeps the young queue tables' statistics up with their growth until autovacuum
    has analyzed each once (one part: the claimer's thread or task)."""

    settings: Settings
    timer: Timer = field(default_factory=lambda: Timer(CHECK_INTERVAL))
    done: bool = False
    # table -> ANALYZEs this dispatcher ran (MOST_PER_TABLE at most); refused ones count
    # as many, never tried again
    analyzed: dict[str, int] = field(default_factory=dict)

    def due(self, now: float) -> bool:
        return not self.done and self.timer.due(now)

    def analyze(self) -> Step[None]:
        """ANALYZE the queue tables that grew past their statistics (``unanalyzed_tables``);
        done once autovacuum keeps every one (or each had ``MOST_PER_TABLE``)."""
        schema = self.settings.schema
        rows = yield Statement(self.settings.queries.unanalyzed_tables,
                               {"schema_name": schema, "tables": list(TABLES), "rows": ROWS},
                               named=True)
        waiting = [table for table in rows
                   if table.name in TABLES and self.analyzed.get(table.name, 0) < MOST_PER_TABLE]
        if not waiting:
            self.done = True
            return
        for table in waiting:
            if not table.ready:
                continue
            self.analyzed[table.name] = self.analyzed.get(table.name, 0) + 1
            try:
                yield Statement(bind_schema("ANALYZE {schema}." + table.name, schema), {},
                                count=True)
            except psycopg.errors.InsufficientPrivilege:
                self.analyzed[table.name] = MOST_PER_TABLE
                log.info("the dispatcher's role may not ANALYZE %s.%s: its statistics "
                         "come from autovacuum", schema, table.name)
