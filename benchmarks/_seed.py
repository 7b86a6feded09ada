"""Putting jobs in place before a clock starts: the product's bulk path, or raw SQL."""

from __future__ import annotations

import time

import psycopg
from psycopg import sql

import outbox
from outbox.sql import fingerprint

from ._db import table
from ._effects import NOOP, payload

CHUNK = 5000

_SEED_PENDING = """
INSERT INTO {jobs} (effect, key, payload, fingerprint)
SELECT %(effect)s, %(prefix)s || g, '{{}}'::jsonb, %(fingerprint)s
FROM generate_series(1, %(n)s) AS g
"""

_SEED_DONE = """
INSERT INTO {jobs} (effect, key, payload, fingerprint, status, attempts, claim_version,
                    first_attempted_at, created_at, updated_at)
SELECT %(effect)s, %(prefix)s || g, '{{}}'::jsonb, %(fingerprint)s, 'done', 1, 1,
       now(), now(), now()
FROM generate_series(1, %(n)s) AS g
"""

_SEED_LEDGER = """
INSERT INTO {ledger} (key, effect, job_id, claim_version, result, fingerprint)
SELECT j.key, j.effect, j.id, j.claim_version, 'null'::jsonb, j.fingerprint
FROM {jobs} j
WHERE j.status = 'done' AND j.key LIKE %(pattern)s
"""


def enqueue_outbox(dsn: str, n: int, schema: str = "outbox", effect: str = NOOP) -> float:
    """Enqueue ``n`` jobs with ``enqueue_many`` in transactions of ``CHUNK``; jobs/s."""
    started = time.perf_counter()
    with psycopg.connect(dsn) as conn:
        for first in range(0, n, CHUNK):
            jobs = [outbox.NewJob(effect, key=f"job-{i}", payload=payload(i))
                    for i in range(first, min(n, first + CHUNK))]
            with outbox.transaction(conn, schema=schema) as tx:
                tx.enqueue_many(jobs)
    return n / (time.perf_counter() - started)


def seed_pending(dsn: str, n: int, prefix: str, schema: str = "outbox",
                 effect: str = NOOP) -> float:
    """Insert ``n`` pending jobs in one SQL statement (generate_series); jobs/s."""
    started = time.perf_counter()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL(_SEED_PENDING).format(jobs=table(schema, "jobs")), {
            "effect": effect, "prefix": prefix, "n": n,
            "fingerprint": fingerprint(effect, "{}"),
        })
    return n / (time.perf_counter() - started)


def seed_history(dsn: str, n: int, schema: str = "outbox", effect: str = NOOP) -> float:
    """Insert ``n`` finished jobs with their ledger rows, as if drained long ago; rows/s."""
    started = time.perf_counter()
    with psycopg.connect(dsn) as conn:
        params = {"effect": effect, "prefix": "history-", "n": n, "pattern": "history-%",
                  "fingerprint": fingerprint(effect, "{}")}
        conn.execute(sql.SQL(_SEED_DONE).format(jobs=table(schema, "jobs")), params)
        conn.execute(sql.SQL(_SEED_LEDGER).format(jobs=table(schema, "jobs"),
                                                  ledger=table(schema, "effect_results")),
                     params)
    return n / (time.perf_counter() - started)
