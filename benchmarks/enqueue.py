"""Section 2, enqueue: what the outbox adds to the business transaction.

(a) One ``tx.enqueue`` inside a transaction that also inserts an order row, against the
    same transaction with a bare INSERT of an equivalent row into a plain table; and the
    same job enqueued by ``SELECT outbox.enqueue(...)``, as a caller in another language
    or a trigger enqueues it.
(b) ``tx.enqueue_many`` of 1000 jobs per transaction against the fastest raw multi-row
    insert (``executemany``, or ``INSERT ... SELECT unnest`` with text or binary
    parameters) of 1000 equivalent rows into a plain table with the same columns and
    indexes.

The variants alternate in small blocks inside one fresh database per run, so drift in
the machine or the table's size affects them alike.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

import outbox

from ._db import Server, fresh_database, migrated
from ._results import Row, Section, Target
from ._stats import Figure, ratios

EFFECT = "email.send"
BULK_ROWS = 1000
BLOCK = 25  # single transactions per variant before switching to the other

# The business's own table, which every comparison of an order transaction writes to.
ORDERS_SETUP = """
CREATE SCHEMA bench;
CREATE TABLE bench.orders (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    customer text NOT NULL,
    total_cents integer NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
"""
_SETUP = ORDERS_SETUP + """
CREATE TABLE bench.plain_jobs (LIKE outbox.jobs INCLUDING ALL);
"""

ORDER = "INSERT INTO bench.orders (customer, total_cents) VALUES (%s, %s)"
_PLAIN_ONE = """
INSERT INTO bench.plain_jobs (effect, key, payload, fingerprint, max_attempts)
VALUES (%s, %s, %s, %s, %s)
"""
_PLAIN_UNNEST = """
INSERT INTO bench.plain_jobs (effect, key, payload, fingerprint, max_attempts)
SELECT * FROM unnest(%s::text[], %s::text[], %s::jsonb[], %s::text[], %s::integer[])
"""
_SQL_ENQUEUE = "SELECT outbox.enqueue(%s, %s, %s)"
# A fingerprint-sized placeholder: the raw baseline has no idempotency to check.
FINGERPRINT = "0" * 64


@dataclass(frozen=True)
class EnqueueConfig:
    runs: int
    single_transactions: int
    bulk_transactions: int


def email(n: int) -> dict[str, Any]:
    """A Resend-shaped email payload, as a shop would enqueue for order ``n``."""
    return {"from": "shop@example.com", "to": f"customer-{n}@example.com",
            "subject": f"Your order {n}", "text": f"Thank you for order {n}. It ships soon."}


# -- (a) one job per business transaction ---------------------------------------------------

def ours_single(conn: psycopg.Connection[Any], n: int) -> None:
    with outbox.transaction(conn) as tx:
        conn.execute(ORDER, (f"customer-{n}", 1999))
        tx.enqueue(EFFECT, key=f"email-order-{n}", payload=email(n))


def _raw_single(conn: psycopg.Connection[Any], n: int) -> None:
    with conn.transaction():
        conn.execute(ORDER, (f"customer-{n}", 1999))
        conn.execute(_PLAIN_ONE, (EFFECT, f"email-order-{n}", Jsonb(email(n)), FINGERPRINT, 25))


def _sql_single(conn: psycopg.Connection[Any], n: int) -> None:
    with conn.transaction():
        conn.execute(ORDER, (f"customer-{n}", 1999))
        conn.execute(_SQL_ENQUEUE, (EFFECT, f"email-order-{n}", Jsonb(email(n))))


def alternate(conn: psycopg.Connection[Any], variants: Mapping[str, Callable[..., None]],
              total: int, block: int, start: int, step: int = 1) -> dict[str, float]:
    """Run each variant ``total`` times in alternating blocks of ``block`` calls, the
    n-th call given ``start + n * step``; the seconds each variant spent."""
    spent = dict.fromkeys(variants, 0.0)
    n = start
    for _ in range(0, total, block):
        for name, variant in variants.items():
            began = time.perf_counter()
            for _ in range(min(block, total)):
                variant(conn, n)
                n += step
            spent[name] += time.perf_counter() - began
    return spent


# -- (b) 1000 jobs per transaction ------------------------------------------------------------

def _ours_bulk(conn: psycopg.Connection[Any], first: int) -> None:
    jobs = [outbox.NewJob(EFFECT, key=f"bulk-{i}", payload=email(i))
            for i in range(first, first + BULK_ROWS)]
    with outbox.transaction(conn) as tx:
        tx.enqueue_many(jobs)


def _raw_executemany(conn: psycopg.Connection[Any], first: int) -> None:
    rows = [(EFFECT, f"bulk-{i}", Jsonb(email(i)), FINGERPRINT, 25)
            for i in range(first, first + BULK_ROWS)]
    with conn.transaction(), conn.cursor() as cur:
        cur.executemany(_PLAIN_ONE, rows)


def _unnest(conn: psycopg.Connection[Any], first: int, binary: bool) -> None:
    numbers = range(first, first + BULK_ROWS)
    with conn.transaction():
        conn.execute(_PLAIN_UNNEST, ([EFFECT] * BULK_ROWS, [f"bulk-{i}" for i in numbers],
                                     [json.dumps(email(i)) for i in numbers],
                                     [FINGERPRINT] * BULK_ROWS, [25] * BULK_ROWS),
                     binary=binary)


def _raw_unnest(conn: psycopg.Connection[Any], first: int) -> None:
    _unnest(conn, first, binary=False)


def _raw_unnest_binary(conn: psycopg.Connection[Any], first: int) -> None:
    # Binary parameters: psycopg sends the arrays without quoting each element.
    _unnest(conn, first, binary=True)


RAW_BULK = {"executemany": _raw_executemany, "unnest": _raw_unnest,
            "unnest (binary)": _raw_unnest_binary}


def _bulk_rates(conn: psycopg.Connection[Any], transactions: int) -> dict[str, float]:
    variants: dict[str, Callable[[psycopg.Connection[Any], int], None]] = {
        "enqueue_many": _ours_bulk, **RAW_BULK}
    spent = dict.fromkeys(variants, 0.0)
    first = 0
    for _ in range(transactions):
        for name, variant in variants.items():
            began = time.perf_counter()
            variant(conn, first)
            spent[name] += time.perf_counter() - began
            first += BULK_ROWS
    return {name: transactions * BULK_ROWS / seconds for name, seconds in spent.items()}


def measure(server: Server, config: EnqueueConfig) -> dict[str, Any]:
    """One run of both sub-benchmarks in a fresh database."""
    with fresh_database(server, "enqueue") as dsn:
        migrated(dsn)
        with psycopg.connect(dsn) as conn:
            with conn.transaction():
                conn.execute(_SETUP)
            # Warm up both paths (prepared statements, caches) outside the measurement.
            singles = {"ours": ours_single, "raw": _raw_single, "sql": _sql_single}
            alternate(conn, singles, 10, 5, 10**8)
            spent = alternate(conn, singles, config.single_transactions, BLOCK, 0)
            single_ms = {k: 1000 * v / config.single_transactions for k, v in spent.items()}
            bulk = _bulk_rates(conn, config.bulk_transactions)
    return {"single_ms": single_ms, "bulk_jobs_per_second": bulk}


def run(server: Server, config: EnqueueConfig) -> Section:
    """``config.runs`` runs; rows for the single-job cost and the bulk throughput."""
    results = [measure(server, config) for _ in range(config.runs)]
    ours_ms = [r["single_ms"]["ours"] for r in results]
    raw_ms = [r["single_ms"]["raw"] for r in results]
    sql_ms = [r["single_ms"]["sql"] for r in results]
    ours_bulk = [r["bulk_jobs_per_second"]["enqueue_many"] for r in results]
    raw_bulk = [max(r["bulk_jobs_per_second"][k] for k in RAW_BULK) for r in results]
    fastest = {max(RAW_BULK, key=lambda k: r["bulk_jobs_per_second"][k]) for r in results}
    rows = [
        Row("enqueue", "tx.enqueue in a business txn (order row + job)", "ms/txn",
            Figure.of(ours_ms), "plain INSERT, same txn", Figure.of(raw_ms),
            ratios(ours_ms, raw_ms), Target("<=", 1.2)),
        Row("enqueue", "SELECT outbox.enqueue(...) in a business txn", "ms/txn",
            Figure.of(sql_ms), "tx.enqueue, same txn", Figure.of(ours_ms),
            ratios(sql_ms, ours_ms)),
        Row("enqueue", f"tx.enqueue_many, {BULK_ROWS} jobs/txn", "jobs/s", Figure.of(ours_bulk),
            f"fastest raw: {', '.join(sorted(fastest))}", Figure.of(raw_bulk),
            ratios(ours_bulk, raw_bulk), Target(">=", 0.8)),
        *(Row("enqueue", f"raw {name}, {BULK_ROWS} rows/txn", "jobs/s",
              Figure.of([r["bulk_jobs_per_second"][name] for r in results]))
          for name in RAW_BULK),
    ]
    settings = {"single": f"{config.single_transactions} txns per variant per run, "
                f"alternating blocks of {BLOCK}",
                "bulk": f"{config.bulk_transactions} txns of {BULK_ROWS} per variant per run",
                "plain table": "LIKE outbox.jobs INCLUDING ALL (same columns and indexes)"}
    return Section("enqueue", rows, raw={"config": vars(config), "runs": results},
                   settings=settings)
