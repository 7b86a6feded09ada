"""A dispatcher process for the fan-in chaos test: ``python -m tests.after.chaos_worker
--schema S`` (DSN from ``$OUTBOX_DATABASE_URL``), killed with -9 at random by the test.

Two effects deliver to a provider modelled as tables, from their own autocommit
connections (as an HTTP call would be made): ``deliveries`` gets a row per delivery (at
least once), ``acted`` one per key (an idempotent provider: ON CONFLICT DO NOTHING). A
child (``fanin.child``, its parents' keys in its payload) also checks, at each delivery,
which of its parents have no ledger row yet, on its own connection: any such delivery is
a row of ``early``, which must stay empty.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import threading
import time
from typing import Any

import psycopg
from psycopg import sql

import outbox

PARENT, CHILD = "fanin.parent", "fanin.child"

DDL = """
CREATE TABLE {schema}.deliveries (key text NOT NULL, pid integer NOT NULL,
                                  at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE {schema}.acted (key text PRIMARY KEY, pid integer NOT NULL);
CREATE TABLE {schema}.early (key text NOT NULL, missing text[] NOT NULL);
"""


class Delivering(outbox.Effect):
    def __init__(self, name: str, dsn: str, schema: str) -> None:
        self.name = name  # type: ignore[misc]
        self.dsn = dsn
        self.s = sql.Identifier(schema)
        self.local = threading.local()

    def connection(self) -> psycopg.Connection[Any]:
        conn: psycopg.Connection[Any] | None = getattr(self.local, "conn", None)
        if conn is None or conn.closed:
            conn = psycopg.connect(self.dsn, autocommit=True)
            self.local.conn = conn
        return conn

    def perform(self, job: outbox.Job) -> dict[str, Any]:
        time.sleep(random.uniform(0, 0.03))  # widen the windows a kill can land in
        try:
            conn = self.connection()
            parents = list(job.payload.get("parents", []))
            if parents:
                missing = [row[0] for row in conn.execute(sql.SQL(
                    "SELECT k FROM unnest(%s::text[]) k WHERE NOT EXISTS "
                    "(SELECT 1 FROM {}.effect_results r WHERE r.key = k)").format(self.s),
                    (parents,))]
                if missing:
                    conn.execute(sql.SQL("INSERT INTO {}.early VALUES (%s, %s)").format(self.s),
                                 (job.key, missing))
                if set(job.after_results) != set(parents):
                    conn.execute(sql.SQL("INSERT INTO {}.early VALUES (%s, %s)").format(self.s),
                                 (job.key, ["after_results: " + ",".join(job.after_results)]))
            conn.execute(sql.SQL("INSERT INTO {}.deliveries (key, pid) VALUES (%s, %s)")
                         .format(self.s), (job.key, os.getpid()))
            conn.execute(sql.SQL("INSERT INTO {}.acted VALUES (%s, %s) ON CONFLICT DO NOTHING")
                         .format(self.s), (job.key, os.getpid()))
        except psycopg.OperationalError as exc:
            self.local.conn = None
            raise outbox.Retry("provider unreachable", after=0.1) from exc
        time.sleep(random.uniform(0, 0.03))
        return {"by": job.key}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.after.chaos_worker")
    parser.add_argument("--schema", required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {os.getpid()} %(levelname)s %(name)s: %(message)s")
    dsn = os.environ["OUTBOX_DATABASE_URL"]
    effects = [Delivering(PARENT, dsn, args.schema), Delivering(CHILD, dsn, args.schema)]
    outbox.Dispatcher(dsn, effects, schema=args.schema, lease=1.0, concurrency=4,
                      poll_interval=0.1, rescue_interval=0.5,
                      backoff=outbox.Backoff(base=0.05, cap=0.2)).run()


if __name__ == "__main__":
    main()
