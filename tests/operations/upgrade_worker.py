"""One process of the online-upgrade test, run with whichever release's ``outbox`` is first
on ``PYTHONPATH``: ``python upgrade_worker.py MODE DSN SCHEMA [PREFIX]``.

``migrate``   migrate the schema with this release; prints the versions applied.
``dispatch``  ``Dispatcher.run()`` with the delivery effect until SIGTERM.
``enqueue``   business transactions of five jobs (every 40th job a slow one) until
              SIGTERM; prints how many it enqueued and its longest transaction.

The delivery effect counts every delivery of a key in ``upgrade_provider.deliveries``
from its own autocommit connection, as a provider would see it.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from typing import Any

import psycopg

import outbox

EFFECT = "upgrade.deliver"
DELIVERIES = """
INSERT INTO upgrade_provider.deliveries AS d (key, times) VALUES (%s, 1)
ON CONFLICT (key) DO UPDATE SET times = d.times + 1
"""


class Deliver(outbox.Effect):
    """Counts deliveries per key; a job whose payload says ``slow`` takes two seconds."""

    name = EFFECT

    def __init__(self, dsn: str) -> None:
        super().__init__()
        self.dsn = dsn
        self.local = threading.local()

    def perform(self, job: outbox.Job) -> None:
        if job.payload.get("slow"):
            time.sleep(2.0)
        conn = getattr(self.local, "conn", None)
        if conn is None:
            conn = self.local.conn = psycopg.connect(self.dsn, autocommit=True)
        conn.execute(DELIVERIES, (job.key,))


def _on_sigterm(stop: threading.Event) -> None:
    signal.signal(signal.SIGTERM, lambda *_: stop.set())


def dispatch(dsn: str, schema: str) -> None:
    dispatcher = outbox.Dispatcher(dsn, [Deliver(dsn)], schema=schema, poll_interval=0.2)
    stop = threading.Event()
    _on_sigterm(stop)
    def stop_when_told() -> None:  # stop() from a thread: a signal handler must not block
        stop.wait()
        dispatcher.stop()

    threading.Thread(target=stop_when_told, daemon=True).start()
    dispatcher.run()


def enqueue(dsn: str, schema: str, prefix: str) -> None:
    stop = threading.Event()
    _on_sigterm(stop)
    sent, longest = 0, 0.0
    with psycopg.connect(dsn) as conn:
        while not stop.is_set():
            started = time.monotonic()
            with outbox.transaction(conn, schema=schema) as tx:
                tx.enqueue_many([outbox.NewJob(
                    EFFECT, key=f"{prefix}-{sent + n}",
                    payload={"slow": (sent + n) % 40 == 0}) for n in range(5)])
            longest = max(longest, time.monotonic() - started)
            sent += 5
            stop.wait(0.01)
    print(json.dumps({"enqueued": sent, "longest": longest}), flush=True)


def main(argv: list[str]) -> None:
    mode, dsn, schema, *rest = argv
    if mode == "migrate":
        with psycopg.connect(dsn, autocommit=True) as conn:
            applied: Any = outbox.migrate(conn, schema=schema)
        print(json.dumps({"applied": applied, "from": outbox.__file__}), flush=True)
    elif mode == "dispatch":
        dispatch(dsn, schema)
    elif mode == "enqueue":
        enqueue(dsn, schema, rest[0])
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
