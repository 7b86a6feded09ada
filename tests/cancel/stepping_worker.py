"""A dispatcher process whose effect acts in 0.1 s steps, each step a row in ``acts``
written only after checking ``job.cancelled``: what a SIGSTOP past the lease leaves it
doing once woken. ``python -m tests.cancel.stepping_worker SCHEMA STEPS``."""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import psycopg
from psycopg import sql

import outbox

EFFECT = "work.acts"


class ActingStepper(outbox.Effect):
    """Each step checks job.cancelled, then acts (a row in ``acts``, autocommitted)."""

    name = EFFECT

    def __init__(self, dsn: str, schema: str, steps: int) -> None:
        self.dsn, self.steps = dsn, steps
        self.insert = sql.SQL(
            "INSERT INTO {}.acts (key, claim_version, step, pid) VALUES (%s, %s, %s, %s)"
        ).format(sql.Identifier(schema))

    def perform(self, job: outbox.Job) -> dict[str, Any]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            for step in range(self.steps):
                if job.cancelled.is_set():
                    raise RuntimeError(f"told to stop at step {step}")
                conn.execute(self.insert, (job.key, job.claim_version, step, os.getpid()))
                time.sleep(0.1)
        return {"steps": self.steps}


def main() -> None:
    schema, steps = sys.argv[1], int(sys.argv[2])
    dsn = os.environ["OUTBOX_DATABASE_URL"]
    dispatcher = outbox.Dispatcher(
        dsn, [ActingStepper(dsn, schema, steps)], schema=schema, lease=1.0,
        concurrency=8, poll_interval=0.2, rescue_interval=0.5,
        backoff=outbox.Backoff(base=0.05, cap=0.2))
    signal.signal(signal.SIGTERM, lambda *_: dispatcher.stop())
    dispatcher.run()


if __name__ == "__main__":
    main()
