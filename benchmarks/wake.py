"""Section 3, wake latency: from the return of an enqueueing commit to the start of
``perform`` in an idle dispatcher running ``run()`` in another process.

Baseline: the floor of any LISTEN/NOTIFY design, a raw psycopg listener in another
process stamping the moment a notification sent by the same kind of commit arrives.
Both stamp with ``time.monotonic_ns()`` (CLOCK_MONOTONIC, one clock for all processes)
and send the stamp through a pipe; samples are spaced by random pauses.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event as EventType
from typing import Any

import psycopg
from psycopg import sql

import outbox

from ._db import Server, fresh_database, migrated
from ._effects import STAMP, Stamp
from ._procs import Prepared, context, service
from ._results import Row, Section, Target
from ._stats import Figure, percentile, ratios

CHANNEL = "bench_wake"
WARM_UP = 3
MAX_SERVICE_SECONDS = 900.0


@dataclass(frozen=True)
class WakeConfig:
    runs: int
    samples: int
    min_gap: float = 0.01
    max_gap: float = 0.1
    sample_timeout: float = 5.0


@dataclass(frozen=True)
class WakeSpec:
    dsn: str
    stamps: Connection
    stop: EventType


# -- the workers (child processes) ----------------------------------------------------------

def dispatcher_worker(spec: WakeSpec) -> Prepared:
    """An idle dispatcher in ``run()``, stopped through ``spec.stop``."""
    dispatcher = outbox.Dispatcher(spec.dsn, [Stamp(spec.stamps)])

    def stop_when_told() -> None:
        spec.stop.wait(MAX_SERVICE_SECONDS)
        dispatcher.stop()

    def run() -> dict[str, Any]:
        threading.Thread(target=stop_when_told, daemon=True).start()
        return dispatcher.run().as_dict()

    return Prepared(run)


def listener_worker(spec: WakeSpec) -> Prepared:
    """A raw LISTEN loop that stamps each notification's arrival."""
    conn = psycopg.connect(spec.dsn, autocommit=True)
    conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(CHANNEL)))

    def run() -> int:
        received = 0
        deadline = time.monotonic() + MAX_SERVICE_SECONDS
        with conn:
            while not spec.stop.is_set() and time.monotonic() < deadline:
                for notify in conn.notifies(timeout=0.1):
                    spec.stamps.send((int(notify.payload), time.monotonic_ns()))
                    received += 1
        return received

    return Prepared(run)


# -- the parent's side ------------------------------------------------------------------------

def _enqueue_job(conn: psycopg.Connection[Any], sample: int, tag: str) -> int:
    with outbox.transaction(conn) as tx:
        tx.enqueue(STAMP, key=f"wake-{tag}-{sample}", payload={"sample": sample})
    return time.monotonic_ns()


def _notify_raw(conn: psycopg.Connection[Any], sample: int, tag: str) -> int:
    with conn.transaction():
        conn.execute("INSERT INTO bench_wake (sample) VALUES (%s)", (sample,))
        conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, str(sample)))
    return time.monotonic_ns()


def _latency_ms(conn: psycopg.Connection[Any], stamps: Connection, sample: int, tag: str,
                send: Any, timeout: float) -> float:
    committed = send(conn, sample, tag)
    while stamps.poll(timeout):
        got, stamped = stamps.recv()
        if got == sample:
            return float(stamped - committed) / 1e6
    raise TimeoutError(f"sample {sample} was not performed within {timeout}s")


def _samples(dsn: str, setup: Any, send: Any, config: WakeConfig, tag: str) -> list[float]:
    ours, theirs = context().Pipe()
    stop = context().Event()
    spec = WakeSpec(dsn, theirs, stop)
    rng = random.Random()
    with service(setup, spec, stop_event=stop, timeout=30.0), psycopg.connect(dsn) as conn:
        theirs.close()
        for i in range(WARM_UP):
            _latency_ms(conn, ours, -1 - i, tag, send, config.sample_timeout)
        latencies = []
        for i in range(config.samples):
            time.sleep(rng.uniform(config.min_gap, config.max_gap))
            latencies.append(_latency_ms(conn, ours, i, tag, send, config.sample_timeout))
    ours.close()
    return latencies


def measure(server: Server, config: WakeConfig, run_number: int) -> dict[str, list[float]]:
    """One run: ``config.samples`` wake-ups of each kind, in a fresh database."""
    with fresh_database(server, "wake") as dsn:
        migrated(dsn)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE bench_wake (sample integer NOT NULL)")
        raw = _samples(dsn, listener_worker, _notify_raw, config, f"raw{run_number}")
        ours = _samples(dsn, dispatcher_worker, _enqueue_job, config, f"ours{run_number}")
    return {"outbox_ms": ours, "listen_notify_ms": raw}


def run(server: Server, config: WakeConfig) -> Section:
    """p50 and p99 of each run, ours beside the raw LISTEN/NOTIFY floor."""
    results = [measure(server, config, i) for i in range(config.runs)]
    rows = []
    for label, fraction, bound in (("p50", 0.5, 5.0), ("p99", 0.99, 50.0)):
        ours = [percentile(r["outbox_ms"], fraction) for r in results]
        raw = [percentile(r["listen_notify_ms"], fraction) for r in results]
        rows.append(Row("wake", f"commit -> perform start, {label}", "ms", Figure.of(ours),
                        "raw LISTEN/NOTIFY", Figure.of(raw), ratios(ours, raw),
                        Target("<=", bound, on="value", unit=" ms")))
    settings = {"samples": f"{config.samples} per run, {config.min_gap * 1000:.0f}-"
                f"{config.max_gap * 1000:.0f} ms random gaps", "dispatcher": "defaults, run()"}
    return Section("wake", rows, raw={"config": vars(config), "runs": results},
                   settings=settings)
