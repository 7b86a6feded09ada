"""Section ``soak``: minutes of steady load, and what the queue's storage does meanwhile.

Enqueuer processes offer ``rate`` no-op jobs a second (business transactions of
``per_transaction`` jobs each, paced on a schedule, not as fast as they can) while
``dispatchers`` processes run ``Dispatcher.run()`` with ``retention`` seconds of done
jobs kept and the ledger's retention off (the ledger is the user's record: its size is
reported apart). Every ``window`` seconds the parent samples:

- storage: the total size (heap, indexes, TOAST) of every relation of the outbox schema
  except the ledger, and of the ledger;
- latency: p50 and p99 of commit-to-done (``updated_at - created_at``) of the jobs done
  in the window;
- the jobs table's live and dead tuples, its HOT ratio (``n_tup_hot_upd /
  n_tup_upd``) so far, and how many times dispatchers and autovacuum vacuumed it;
- jobs offered and done so far.

Figures: storage at the end over storage at ``2 x retention`` (bounded: <= 1.3), p99 at
the end over p99 at ``2 x retention`` (<= 3), the HOT ratio, the most dead tuples in a
window after ``2 x retention``, the vacuums, and at the end every job offered done once
(its ledger row there, no job left pending past the drain).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from multiprocessing.synchronize import Event as EventType
from typing import Any

import psycopg
from psycopg.rows import dict_row

import outbox

from ._db import Server, fresh_database, migrated
from ._effects import Noop
from ._procs import context
from ._results import Row, Section, Target
from ._stats import Figure

SCHEMA = "outbox"
LEDGER = "effect_results"


@dataclass(frozen=True)
class SoakConfig:
    seconds: float = 600.0
    rate: float = 4000.0
    per_transaction: int = 10
    dispatchers: int = 2
    enqueuers: int = 2
    retention: float = 60.0
    window: float = 10.0


_STORAGE = """
SELECT coalesce(sum(pg_total_relation_size(c.oid))
                FILTER (WHERE c.relname <> %(ledger)s), 0) AS queue,
       coalesce(sum(pg_total_relation_size(c.oid))
                FILTER (WHERE c.relname = %(ledger)s), 0) AS ledger
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = %(schema)s AND c.relkind IN ('r', 'p', 'm')
"""

_TUPLES = """
SELECT n_live_tup AS live, n_dead_tup AS dead, n_tup_upd AS updates,
       n_tup_hot_upd AS hot_updates, vacuum_count AS vacuums,
       autovacuum_count AS autovacuums
FROM pg_stat_user_tables WHERE schemaname = %(schema)s AND relname = 'jobs'
"""

_LATENCY = """
SELECT count(*) AS done,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM updated_at - created_at))
           AS p50,
       percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM updated_at - created_at))
           AS p99
FROM outbox.jobs WHERE status = 'done' AND updated_at >= now() - make_interval(secs => %(window)s)
"""


_LEDGER_ROWS = "SELECT count(*) AS n FROM outbox.effect_results"
_END = """
SELECT (SELECT count(*) FROM outbox.effect_results) AS ledger,
       (SELECT count(*) FROM outbox.jobs WHERE status <> 'done') AS unfinished
"""


def _dispatch(dsn: str, retention: float, stop: EventType) -> None:
    """A dispatcher process: ``run()`` until the parent sets ``stop``."""
    dispatcher = outbox.Dispatcher(dsn, [Noop()], concurrency=16, retention=retention,
                                   ledger_retention=None)
    def stop_when_told() -> None:
        stop.wait()
        dispatcher.stop()

    threading.Thread(target=stop_when_told, daemon=True).start()
    dispatcher.run()


def _enqueue(dsn: str, prefix: str, tx_per_second: float, per_transaction: int,
             seconds: float, offered: Any) -> None:
    """An enqueuer process: ``tx_per_second`` business transactions on a fixed schedule
    (behind schedule, it catches up at once: the offered rate holds on average)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        started = time.monotonic()
        sent = 0
        while (now := time.monotonic()) - started < seconds:
            due = int((now - started) * tx_per_second)
            if sent >= due:
                time.sleep(min(0.01, (sent + 1) / tx_per_second - (now - started)))
                continue
            with outbox.transaction(conn) as tx:
                tx.enqueue_many([outbox.NewJob(Noop.name, key=f"{prefix}-{sent}-{n}",
                                               payload={"n": n})
                                 for n in range(per_transaction)])
            sent += 1
            with offered.get_lock():
                offered.value += per_transaction


def _sample(conn: psycopg.Connection[dict[str, Any]], window: float) -> dict[str, Any]:
    params = {"schema": SCHEMA, "ledger": LEDGER, "window": window}
    storage = conn.execute(_STORAGE, params).fetchone() or {}
    tuples = conn.execute(_TUPLES, params).fetchone() or {}
    latency = conn.execute(_LATENCY, params).fetchone() or {}
    return {**storage, **tuples, **latency}


def soak(server: Server, config: SoakConfig) -> dict[str, Any]:
    """One soak; the samples per window and the end state."""
    ctx = context()
    with fresh_database(server, "soak") as dsn:
        migrated(dsn)
        stop = ctx.Event()
        offered = ctx.Value("q", 0)
        dispatchers = [ctx.Process(target=_dispatch, args=(dsn, config.retention, stop))
                       for _ in range(config.dispatchers)]
        tx_rate = config.rate / config.per_transaction / config.enqueuers
        enqueuers = [ctx.Process(target=_enqueue, args=(
            dsn, f"soak{n}", tx_rate, config.per_transaction, config.seconds, offered))
            for n in range(config.enqueuers)]
        for process in [*dispatchers, *enqueuers]:
            process.start()
        samples: list[dict[str, Any]] = []
        started = time.monotonic()
        with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
            while (elapsed := time.monotonic() - started) < config.seconds:
                time.sleep(max(0.0, config.window * (len(samples) + 1) - elapsed))
                sample = _sample(conn, config.window)
                sample.update(at=round(time.monotonic() - started, 1), offered=offered.value)
                samples.append(sample)
            for process in enqueuers:
                process.join()
            total = int(offered.value)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:  # the drain of what was offered last
                row = conn.execute(_LEDGER_ROWS).fetchone()
                if row and row["n"] >= total:
                    break
                time.sleep(0.5)
            stop.set()
            for process in dispatchers:
                process.join(60)
            end = conn.execute(_END).fetchone() or {}
    return {"samples": samples, "offered": total, **end}


def _at(samples: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    """The first sample taken at or after ``seconds``."""
    return next((s for s in samples if s["at"] >= seconds), samples[-1])


def run(server: Server, config: SoakConfig) -> Section:
    """One soak (minutes of it: the figures are windows of one run, not repeats)."""
    result = soak(server, config)
    samples = result["samples"]
    early, last = _at(samples, 2 * config.retention), samples[-1]
    settled = _at(samples, max(5 * config.retention, config.seconds / 2))
    if result["ledger"] != result["offered"] or result["unfinished"]:
        raise AssertionError(f"soak: {result['offered']} offered, {result['ledger']} ledger "
                             f"rows, {result['unfinished']} jobs not done at the end")
    hot = last["hot_updates"] / last["updates"] if last["updates"] else 0.0
    deadliest = max((s for s in samples if s["at"] >= early["at"]), key=lambda s: s["dead"])
    name = (f"{config.seconds:g} s at {config.rate:g} jobs/s offered, {config.dispatchers} "
            f"dispatcher processes, retention {config.retention:g} s")
    rows = [
        Row("soak", f"{name}: queue storage at the end", "MiB",
            Figure.of([last["queue"] / 2**20]), f"at {early['at']:g} s",
            Figure.of([early["queue"] / 2**20]),
            Figure.of([last["queue"] / max(early["queue"], 1)]), Target("<=", 1.3)),
        Row("soak", f"{name}: p99 commit-to-done in the last {config.window:g} s", "ms",
            Figure.of([1000 * (last["p99"] or 0.0)]), f"at {early['at']:g} s",
            Figure.of([1000 * (early["p99"] or 0.0)]),
            Figure.of([(last["p99"] or 0.0) / max(early["p99"] or 0.0, 1e-6)]),
            Target("<=", 3.0)),
        # The plateau itself: the load may still be ramping up at 2 x retention (enqueuers
        # behind their schedule catch up), so the end is also set against a later window.
        Row("soak", f"{name}: queue storage at the end", "MiB",
            Figure.of([last["queue"] / 2**20]), f"at {settled['at']:g} s",
            Figure.of([settled["queue"] / 2**20]),
            Figure.of([last["queue"] / max(settled["queue"], 1)]), Target("<=", 1.1)),
        Row("soak", f"{name}: jobs offered a second, the last 60 s", "jobs/s",
            Figure.of([(last["offered"] - _at(samples, last["at"] - 60)["offered"]) / 60])),
        Row("soak", f"{name}: HOT updates of jobs", "share", Figure.of([hot])),
        Row("soak", f"{name}: dead rows in jobs, the most in a window after "
            f"{early['at']:g} s", "rows", Figure.of([float(deadliest["dead"])]),
            "live rows then", Figure.of([float(deadliest["live"])])),
        Row("soak", f"{name}: vacuums of jobs by dispatchers (autovacuum's beside)", "vacuums",
            Figure.of([float(last["vacuums"])]), "autovacuum",
            Figure.of([float(last["autovacuums"])])),
        Row("soak", f"{name}: jobs offered, each done once (ledger rows)", "jobs",
            Figure.of([float(result["ledger"])]), "offered",
            Figure.of([float(result["offered"])])),
    ]
    settings = {"dispatcher": "Dispatcher, concurrency 16, retention as above, "
                "ledger_retention=None", "enqueue": f"{config.per_transaction} jobs per "
                f"transaction, {config.enqueuers} enqueuer processes on a fixed schedule"}
    return Section("soak", rows, raw={"config": vars(config), **result}, settings=settings)


__all__ = ["SoakConfig", "run", "soak"]
