"""A dispatcher process for the schedules' fleet test:
``python -m tests.schedules.worker --schema S``.

Runs ``Dispatcher.run()`` (until SIGTERM) declaring two schedules of one second, ``all``
(catch_up="all") and ``latest`` (catch_up="latest"), or with ``--dst`` two cron schedules
in Berlin (``--clock``: a fake clock that runs through a DST night in seconds), of an
effect that records each delivery in the table ``performed`` from its own connection, as
a provider would: one row per key (an idempotent provider acts once), ``deliveries``
counting the calls.
The DSN comes from ``$OUTBOX_DATABASE_URL``; logs go to stderr.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg import sql

import outbox

EFFECT = "sched.provider"
DDL = """
CREATE TABLE {schema}.performed (
    key text PRIMARY KEY, slot timestamptz NOT NULL, deliveries integer NOT NULL,
    pid integer NOT NULL)
"""
_DELIVER = """
INSERT INTO {schema}.performed AS p (key, slot, deliveries, pid) VALUES (%s, %s, 1, %s)
ON CONFLICT (key) DO UPDATE SET deliveries = p.deliveries + 1
"""


class Provider(outbox.Effect):
    """Records each delivery from a connection of its own (one per worker thread)."""

    name = EFFECT

    def __init__(self, dsn: str, schema: str) -> None:
        self.dsn = dsn
        self.deliver = sql.SQL(_DELIVER).format(schema=sql.Identifier(schema))
        self.local = threading.local()

    def perform(self, job: outbox.Job) -> dict[str, Any]:
        conn = getattr(self.local, "conn", None)
        if conn is None:
            conn = self.local.conn = psycopg.connect(self.dsn, autocommit=True)
        conn.execute(self.deliver, (job.key, job.scheduled_for, os.getpid()))
        return {}


def schedules(dst: bool) -> list[outbox.Schedule]:
    if dst:  # Berlin's autumn night: 03:00 CEST -> 02:00 CET
        return [outbox.Schedule("nightly", effect=EFFECT, cron="30 2 * * *",
                                timezone="Europe/Berlin", catch_up="all"),
                outbox.Schedule("half", effect=EFFECT, cron="*/30 * * * *",
                                timezone="Europe/Berlin", catch_up="all")]
    return [outbox.Schedule("all", effect=EFFECT, every=1, catch_up="all"),
            outbox.Schedule("latest", effect=EFFECT, every=1, catch_up="latest")]


def fake_clock(start: str, anchor: float, speed: float) -> Callable[[], datetime]:
    """A clock at ``start`` at the Unix time ``anchor``, running ``speed`` times as fast:
    the same in every process given the same arguments."""
    origin = datetime.fromisoformat(start)
    return lambda: origin + timedelta(seconds=(time.time() - anchor) * speed)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schema", required=True)
    parser.add_argument("--dst", action="store_true", help="the cron schedules of a DST night")
    parser.add_argument("--clock", nargs=3, metavar=("START", "ANCHOR", "SPEED"),
                        help="the scheduler's fake clock (fake_clock)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    dsn = os.environ["OUTBOX_DATABASE_URL"]
    dispatcher = outbox.Dispatcher(dsn, effects=[Provider(dsn, args.schema)],
                                   schema=args.schema, lease=2.0, concurrency=2,
                                   schedules=schedules(args.dst))
    if args.clock:
        start, anchor, speed = args.clock
        dispatcher._schedule_clock = fake_clock(start, float(anchor), float(speed))
    # A SIGTERM before run() installs its own handler (or after it restored ours) stops
    # the dispatcher all the same: the process always ends with status 0.
    # (On a thread, as run()'s own handler does: stop() may wait on a lock.)
    signal.signal(signal.SIGTERM, lambda signum, frame: threading.Thread(
        target=dispatcher.stop, daemon=True).start())
    dispatcher.run()


if __name__ == "__main__":
    main()
