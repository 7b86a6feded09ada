"""Helpers of the limit tests: enqueueing, reading the jobs and the shared state, and
dispatcher processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

import outbox

REPO = Path(__file__).resolve().parents[2]
EMAIL = {"from": "shop@example.com", "to": "customer@example.com", "subject": "Your order",
         "text": "Thank you."}


def enqueue(dsn: str, schema: str, effect: str, keys: Sequence[str],
            payload: dict[str, Any] | None = None, max_attempts: int | None = None) -> None:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue_many([outbox.NewJob(effect, key, payload or {}, max_attempts=max_attempts)
                         for key in keys])


def rows(dsn: str, query: str, schema: str, params: Any = None) -> list[tuple[Any, ...]]:
    """Run ``query`` with ``{schema}`` bound to the quoted schema."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        composed = sql.SQL(query).format(schema=sql.Identifier(schema))
        return conn.execute(composed, params).fetchall()


def status_counts(dsn: str, schema: str, effect: str | None = None) -> dict[str, int]:
    found = rows(dsn, "SELECT status, count(*) FROM {schema}.jobs "
                 "WHERE %s::text IS NULL OR effect = %s GROUP BY status", schema, (effect, effect))
    return {status: count for status, count in found}


def first_claims(dsn: str, schema: str, effect: str) -> list[datetime]:
    """When each job of ``effect`` was first claimed (the database's clock), in order."""
    return [r[0] for r in rows(dsn, "SELECT first_attempted_at FROM {schema}.jobs "
                               "WHERE effect = %s AND first_attempted_at IS NOT NULL "
                               "ORDER BY first_attempted_at", schema, (effect,))]


def limit_row(dsn: str, schema: str, effect: str) -> dict[str, Any] | None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(sql.SQL("SELECT * FROM {}.effect_limits WHERE effect = %s").format(
            sql.Identifier(schema)), (effect,))
        row = cur.fetchone()
        if row is None:
            return None
        assert cur.description is not None
        return {c.name: v for c, v in zip(cur.description, row, strict=True)}


def wait_until(predicate: Callable[[], object], what: str, timeout: float = 60.0) -> None:
    """Poll ``predicate`` until truthy; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.02)


def start_workers(n: int, dsn: str, schema: str, *args: str) -> list[subprocess.Popen[str]]:
    """``n`` dispatcher processes (``tests.limits.worker``), started together."""
    command = [sys.executable, "-m", "tests.limits.worker", "--dsn", dsn, "--schema", schema,
               *args]
    return [subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONWARNINGS": "error"})
            for _ in range(n)]


def finish(workers: list[subprocess.Popen[str]], timeout: float = 120.0) -> list[dict[str, Any]]:
    """Wait for every worker; each must exit 0. Their stats."""
    stats = []
    try:
        for worker in workers:
            out, err = worker.communicate(timeout=timeout)
            assert worker.returncode == 0, f"worker failed ({worker.returncode}): {err[-2000:]}"
            stats.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    return stats


def max_overlap(intervals: Sequence[tuple[datetime, datetime]]) -> int:
    """The most intervals open at one instant."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals],
                    key=lambda ev: (ev[0], ev[1]))
    open_now = most = 0
    for _, step in events:
        open_now += step
        most = max(most, open_now)
    return most


def assert_within_rate(claims: list[datetime], rate: float, burst: float,
                       slack: timedelta) -> None:
    """The i-th claim (0-based) came no sooner than (i + 1 - burst) / rate after the first:
    what a token bucket of ``rate`` holding ``burst`` allows, whoever claimed, less
    ``slack`` (what the caller's clocks may add: the bucket's rounding, or the moment
    between a grant and the claim it allows)."""
    start = claims[0]
    for i, at in enumerate(claims):
        earliest = start + timedelta(seconds=max(0.0, (i + 1 - burst) / rate)) - slack
        assert at >= earliest, f"claim {i} at {at - start} came before {earliest - start}"
