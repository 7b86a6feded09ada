"""Section ``upgrade``: what a migration does to business transactions on a large table.

A database at the previous release's schema version (9) holds ``history`` done jobs. A
business thread enqueues 10 jobs a transaction, back to back, and times every
transaction, while the schema is migrated to this release's version:

- ``online``: ``outbox.migrate(conn)`` on an idle connection, as ``outbox migrate`` runs
  it (each migration a transaction of its own, each lock waited for at most
  ``lock_timeout``, the index on ``jobs`` built ``CONCURRENTLY`` after the run commits);
- ``in one transaction``: the same migrations inside a transaction the caller opened
  (what Django's ``migrate`` does): the index is built there, holding its lock.

Figures: the longest business transaction while the migration ran, against the median
one before it; and the migration's own wall clock. Each variant in a fresh database.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import psycopg

import outbox
from outbox.sql import bind_schema

from ._db import Server, fresh_database, settle
from ._effects import NOOP
from ._results import Row, Section
from ._seed import seed_history
from ._stats import Figure, percentile

SCHEMA = "outbox"
PREVIOUS_VERSION = 9


@dataclass(frozen=True)
class UpgradeConfig:
    runs: int
    history: int


# The previous release's business code enqueues with its own statement: this one's
# writes columns the old schema lacks. Its shape: an insert unless the key is a job or a
# ledger row, and a notify.
_OLD_ENQUEUE = """
INSERT INTO {schema}.jobs (effect, key, payload, fingerprint)
SELECT %(effect)s, k, '{{}}'::jsonb, 'f' FROM unnest(%(keys)s::text[]) AS k
WHERE NOT EXISTS (SELECT 1 FROM {schema}.effect_results r WHERE r.key = k)
ON CONFLICT (key) DO NOTHING
"""


class Business:
    """Enqueues 10 jobs a transaction until stopped, as the previous release's business
    code does; every transaction's start and length."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.stop = threading.Event()
        self.timings: list[tuple[float, float]] = []
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._guarded, daemon=True)

    def _guarded(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # re-raised by the measurement
            self.failure = exc

    def _run(self) -> None:
        sent = 0
        enqueue = bind_schema(_OLD_ENQUEUE, SCHEMA)
        with psycopg.connect(self.dsn) as conn:
            while not self.stop.is_set():
                began = time.perf_counter()
                with conn.transaction():
                    conn.execute(enqueue, {"effect": NOOP, "keys": [
                        f"business-{sent + n}" for n in range(10)]})
                    conn.execute("SELECT pg_notify('outbox', '')")
                self.timings.append((began, time.perf_counter() - began))
                sent += 10
                time.sleep(0.005)

    def between(self, start: float, end: float) -> list[float]:
        """Lengths of the transactions that were open at any time in [start, end]."""
        return [length for began, length in self.timings
                if began <= end and began + length >= start]


def _one(server: Server, config: UpgradeConfig, how: str) -> dict[str, Any]:
    with fresh_database(server, f"upgrade-{how.split(maxsplit=1)[0]}") as dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:  # the previous release's schema
            outbox.migrate(conn, schema=SCHEMA, target=PREVIOUS_VERSION)
        seed_history(dsn, config.history)
        settle(dsn)
        business = Business(dsn)
        business.thread.start()
        time.sleep(2.0)  # the business load's own pace, before
        with psycopg.connect(dsn, autocommit=True) as conn:
            started = time.perf_counter()
            if how == "online":
                outbox.migrate(conn, schema=SCHEMA)
            else:
                with conn.transaction():
                    outbox.migrate(conn, schema=SCHEMA)
            ended = time.perf_counter()
        time.sleep(1.0)
        business.stop.set()
        business.thread.join(60)
        if business.failure is not None:
            raise RuntimeError("the business load failed") from business.failure
        before = [length for began, length in business.timings if began + length < started]
        during = business.between(started, ended)
        return {"how": how, "migration_seconds": ended - started,
                "before_p50": percentile(before, 0.5), "during_max": max(during, default=0.0),
                "during_count": len(during)}


def run(server: Server, config: UpgradeConfig) -> Section:
    """Each variant ``runs`` times, interleaved, a fresh database each."""
    results: dict[str, list[dict[str, Any]]] = {"online": [], "in one transaction": []}
    for _ in range(config.runs):
        for how, found in results.items():
            found.append(_one(server, config, how))
    rows = []
    label = f"{config.history:,} done jobs"
    for how, found in results.items():
        longest = [1000 * r["during_max"] for r in found]
        typical = [1000 * r["before_p50"] for r in found]
        rows.append(Row("upgrade", f"longest enqueue transaction during the migration "
                        f"({how}), {label}", "ms", Figure.of(longest),
                        "median before it", Figure.of(typical),
                        Figure.of([a / b for a, b in zip(longest, typical, strict=True)])))
        rows.append(Row("upgrade", f"migration {PREVIOUS_VERSION} -> latest ({how}), {label}",
                        "s", Figure.of([r["migration_seconds"] for r in found])))
    settings = {"history": f"{label} at schema version {PREVIOUS_VERSION}, VACUUM ANALYZE",
                "business": "one connection, 10 jobs a transaction, 5 ms apart"}
    return Section("upgrade", rows, raw={"config": asdict(config), "results": results},
                   settings=settings)
