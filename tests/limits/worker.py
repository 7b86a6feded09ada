"""A dispatcher process for the limit tests: ``python -m tests.limits.worker [options]``.

Runs ``Dispatcher.run_until_idle()`` (or ``run()`` until SIGTERM with ``--run``) on the
schema given, with one effect: ``email`` (``SendEmail`` against ``--url``) or ``trace``
(sleeps ``--seconds``, writing when each perform started and ended to the table
``limit_trace``). ``--limit 10/s`` declares the effect's limit. Prints the stats as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any

import psycopg
from psycopg import sql

import outbox
from effects.email import SendEmail
from outbox.limits import parse_limit

TRACE_EFFECT = "trace.sleep"


class TraceEffect(outbox.Effect):
    """Sleeps, recording each perform's start and end (the database's clock) per key."""

    name = TRACE_EFFECT

    def __init__(self, dsn: str, schema: str, seconds: float) -> None:
        self.dsn, self.seconds = dsn, seconds
        self.table = sql.SQL("{}.limit_trace").format(sql.Identifier(schema))
        self.local = threading.local()

    def _conn(self) -> psycopg.Connection[Any]:
        conn = getattr(self.local, "conn", None)
        if conn is None:
            conn = self.local.conn = psycopg.connect(self.dsn, autocommit=True)
        return conn

    def perform(self, job: outbox.Job) -> None:
        conn = self._conn()
        started = conn.execute("SELECT clock_timestamp()").fetchone()
        time.sleep(self.seconds)
        conn.execute(sql.SQL("INSERT INTO {} (key, pid, started, ended) "
                             "VALUES (%s, %s, %s, clock_timestamp())").format(self.table),
                     (job.key, os.getpid(), started[0] if started else None))


def create_trace_table(conn: psycopg.Connection[Any], schema: str) -> None:
    """The table ``trace`` performs write to, and the workers' start barrier."""
    conn.execute(sql.SQL("CREATE TABLE {}.limit_trace (key text, pid integer, "
                         "started timestamptz, ended timestamptz)").format(sql.Identifier(schema)))
    conn.execute(sql.SQL("CREATE TABLE {}.limit_ready (pid integer)").format(
        sql.Identifier(schema)))


def wait_for_each_other(dsn: str, schema: str, n: int) -> None:
    """A barrier in the database: each worker signs in, then waits until ``n`` have, so
    a slow-starting process does not find the work already done."""
    ready = sql.SQL("{}.limit_ready").format(sql.Identifier(schema))
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("INSERT INTO {} VALUES (%s)").format(ready), (os.getpid(),))
        deadline = time.monotonic() + 60.0
        while True:
            row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(ready)).fetchone()
            if row is not None and row[0] >= n:
                return
            if time.monotonic() > deadline:
                raise SystemExit(f"only {row[0] if row else 0} of {n} workers started")
            time.sleep(0.01)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dsn", required=True)
    p.add_argument("--schema", required=True)
    p.add_argument("--effect", choices=["email", "trace"], required=True)
    p.add_argument("--url", default="")
    p.add_argument("--seconds", type=float, default=0.1)
    p.add_argument("--limit", default=None)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prefetch", type=int, default=None)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--together", type=int, default=1,
                   help="start dispatching only once this many workers are ready")
    args = p.parse_args(argv)
    effect: outbox.Effect = (SendEmail("re_test_key", base_url=args.url) if args.effect == "email"
                             else TraceEffect(args.dsn, args.schema, args.seconds))
    limits = None if args.limit is None else {effect.name: parse_limit(args.limit)}
    dispatcher = outbox.Dispatcher(args.dsn, [effect], schema=args.schema, limits=limits,
                                   concurrency=args.concurrency, prefetch=args.prefetch,
                                   poll_interval=0.2)
    if args.together > 1:
        wait_for_each_other(args.dsn, args.schema, args.together)
    stats = dispatcher.run_until_idle(timeout=args.timeout)
    sys.stdout.write(json.dumps(stats.as_dict()) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
