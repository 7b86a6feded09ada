"""Section ``retention``: what retiring a day of done jobs costs, and what it costs the drain.

A database holds ``history`` done jobs and their ledger rows, all two days old (a day's
worth at the rate the figure names). Two ways of retiring them are measured, each in a
database of its own:

- ``dispatcher``: the dispatcher's own retention (``retention`` and ``ledger_retention``
  of one day): batches of ``RETENTION_BATCH`` rows, ``PURGE_BATCHES`` a round per table,
  a round a second while it is behind. A ``Dispatcher.run()`` process with nothing to
  perform does it; the clock runs until no row is left.
- ``one DELETE``: one statement per table, as a hand-written cron job would.

In each database, drains of ``jobs`` pending no-op jobs (``run_until_idle`` in another
process, retention off) run first with nothing being retired (the baseline), then while
the retirement runs. Figures: the wall clock of each retirement, and the drain's
throughput during it over its baseline in the same database.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field, replace
from multiprocessing.synchronize import Event as EventType
from typing import Any

import psycopg
from psycopg import sql

import outbox
from outbox.sql import fingerprint

from ._db import Server, fresh_database, migrated, scalar, settle, table
from ._drain_workers import OutboxSettings, OutboxSpec, outbox_worker
from ._effects import NOOP
from ._procs import Prepared, context, run_released, service
from ._results import Row, Section
from ._seed import seed_pending
from ._stats import Figure, ratios

SCHEMA = "outbox"
DAY = 86400.0

_SEED = """
WITH done AS (
    INSERT INTO {jobs} (effect, key, payload, fingerprint, status, attempts, claim_version,
                        first_attempted_at, created_at, updated_at)
    SELECT %(effect)s, 'old-' || g, '{{}}'::jsonb, %(fingerprint)s, 'done', 1, 1,
           now() - interval '2 days', now() - interval '2 days', now() - interval '2 days'
    FROM generate_series(%(first)s, %(last)s) AS g
    RETURNING id, key, effect, claim_version, fingerprint
)
INSERT INTO {ledger} (key, effect, job_id, claim_version, result, fingerprint, recorded_at)
SELECT d.key, d.effect, d.id, d.claim_version, 'null'::jsonb, d.fingerprint,
       now() - interval '2 days'
FROM done d
"""

_DELETE_JOBS = "DELETE FROM {jobs} WHERE status = 'done' AND updated_at < now() - interval '1 day'"
_DELETE_LEDGER = "DELETE FROM {ledger} WHERE recorded_at < now() - interval '1 day'"
_LEFT = """
SELECT (SELECT count(*) FROM {jobs}
        WHERE status = 'done' AND updated_at < now() - interval '1 day') +
       (SELECT count(*) FROM {ledger} WHERE recorded_at < now() - interval '1 day')
"""
_SIZE = "SELECT pg_total_relation_size(%s::regclass) + pg_total_relation_size(%s::regclass)"


@dataclass(frozen=True)
class RetentionConfig:
    runs: int
    history: int
    jobs: int
    outbox: OutboxSettings = field(default_factory=OutboxSettings)


@dataclass(frozen=True)
class RetireSpec:
    dsn: str
    stop: EventType
    timeout: float


class Unused(outbox.Effect):
    """An effect no job names: the retiring dispatcher claims nothing."""

    name = "bench.unused"

    def perform(self, job: outbox.Job) -> None:
        raise AssertionError(f"no job of {self.name} was enqueued")


def retire_worker(spec: RetireSpec) -> Prepared:
    """A dispatcher with nothing to perform: what it does is its retention."""
    dispatcher = outbox.Dispatcher(spec.dsn, [Unused()], retention=DAY, ledger_retention=DAY)

    def stop_when_told() -> None:
        spec.stop.wait(spec.timeout)
        dispatcher.stop()

    def run() -> None:
        threading.Thread(target=stop_when_told, daemon=True).start()
        dispatcher.run()

    return Prepared(run)


def _names() -> dict[str, sql.Composed]:
    return {"jobs": table(SCHEMA, "jobs"), "ledger": table(SCHEMA, "effect_results")}


def _seed(dsn: str, history: int) -> float:
    started = time.perf_counter()
    with psycopg.connect(dsn, autocommit=True) as conn:
        for first in range(1, history + 1, 1_000_000):
            conn.execute(sql.SQL(_SEED).format(**_names()), {
                "effect": NOOP, "fingerprint": fingerprint(NOOP, "{}"),
                "first": first, "last": min(history, first + 999_999)})
    return time.perf_counter() - started


def _size(dsn: str) -> int:
    return int(scalar(dsn, _SIZE, (f"{SCHEMA}.jobs", f"{SCHEMA}.effect_results")))


def _drain(dsn: str, config: RetentionConfig, prefix: str) -> float:
    seed_pending(dsn, config.jobs, prefix=prefix)
    timeout = 60.0 + config.jobs / 100
    released = run_released(outbox_worker, [OutboxSpec(dsn, _drain_settings(config), timeout)],
                            timeout=timeout + 30)
    if released.results[0]["done"] != config.jobs:
        raise AssertionError(f"retention drain finished {released.results[0]['done']} jobs")
    return config.jobs / released.seconds


def _drain_settings(config: RetentionConfig) -> OutboxSettings:
    """Retention off in the drain: retiring the history is the other process's work."""
    return replace(config.outbox, options={
        **config.outbox.options, "retention": None, "ledger_retention": None})


def _retire(server: Server, config: RetentionConfig, how: str) -> dict[str, Any]:
    """One database: seed, baseline drains, then drains while ``how`` retires the rows."""
    with fresh_database(server, f"retention-{how.replace(' ', '-')}") as dsn:
        migrated(dsn)
        seeded_in = _seed(dsn, config.history)
        settle(dsn)
        size_before = _size(dsn)
        baseline = [_drain(dsn, config, f"before{n}-") for n in range(config.runs)]
        left = sql.SQL(_LEFT).format(**_names())
        during: list[float] = []
        started = time.perf_counter()
        if how == "dispatcher":
            stop = context().Event()
            timeout = 600.0 + config.history / 1000
            with service(retire_worker, RetireSpec(dsn, stop, timeout), stop_event=stop,
                         timeout=timeout):
                during = [_drain(dsn, config, f"during{n}-") for n in range(config.runs)]
                retire_seconds = _until_none_left(dsn, left, started, timeout)
        else:
            deleting = threading.Thread(target=_delete_all, args=(dsn,))
            deleting.start()
            during = [_drain(dsn, config, f"during{n}-") for n in range(config.runs)]
            deleting.join()
            retire_seconds = time.perf_counter() - started
            if deleting.is_alive() or scalar(dsn, left):
                raise AssertionError("the DELETE left rows behind")
        return {"how": how, "seeded_in": seeded_in, "size_before": size_before,
                "size_after": _size(dsn), "retire_seconds": retire_seconds,
                "baseline": baseline, "during": during}


def _delete_all(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for statement in (_DELETE_JOBS, _DELETE_LEDGER):
            conn.execute(sql.SQL(statement).format(**_names()))


def _until_none_left(dsn: str, left: sql.Composed, started: float, timeout: float) -> float:
    while scalar(dsn, left):
        if time.perf_counter() - started > timeout:
            raise AssertionError(f"retention had not retired the history after {timeout:g} s")
        time.sleep(0.5)
    return time.perf_counter() - started


def run(server: Server, config: RetentionConfig) -> Section:
    """Both ways, one database each."""
    results = [_retire(server, config, how) for how in ("dispatcher", "one DELETE")]
    name = f"{config.history:,} done jobs and their ledger rows"
    rows = []
    for result in results:
        how = result["how"]
        rows.append(Row("retention", f"retire {name}: {how}", "s",
                        Figure.of([result["retire_seconds"]]), "rows a second",
                        Figure.of([2 * config.history / result["retire_seconds"]])))
        rows.append(Row("retention", f"drain {config.jobs:,} while {how} retires", "jobs/s",
                        Figure.of(result["during"]), "before, same database",
                        Figure.of(result["baseline"]),
                        ratios(result["during"], result["baseline"])))
        rows.append(Row("retention", f"jobs + ledger storage after {how} retired {name}",
                        "MiB", Figure.of([result["size_after"] / 2**20]), "before",
                        Figure.of([result["size_before"] / 2**20])))
    settings = {"history": f"{name}, two days old; retention and ledger_retention one day",
                "drain": f"{config.jobs:,} no-op jobs, run_until_idle, "
                f"{_drain_settings(config).describe()}"}
    raw = {"config": asdict(config), "results": results}
    return Section("retention", rows, raw=raw, settings=settings)
