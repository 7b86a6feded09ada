"""One side of ``python -m benchmarks.drain_threads --small``: a process that times small
``run_until_idle`` drains of whichever ``outbox`` its ``PYTHONPATH`` finds.

Run as a script (``python benchmarks/_small_drain.py DSN SCHEMA CONCURRENCY``), not as a
module of the benchmarks package, so that the ``outbox`` it imports can be another
checkout's: it uses only the public API that every version has (``migrate``,
``transaction``, ``enqueue_many``, ``Dispatcher``). It prints ``ready <outbox's path>``,
then answers each line ``N`` read from stdin (enqueue ``N`` no-op jobs, then drain them
with one ``run_until_idle`` of the same dispatcher every round) with
``<wall seconds> <process CPU seconds> <worker threads started>`` of the drain alone
(threads named ``outbox-worker-*``, counted as they start); it ends at end of input.
"""

from __future__ import annotations

import sys
import threading
import time

import psycopg

import outbox

NOOP = "bench.noop"


class Noop(outbox.Effect):
    name = NOOP

    def perform(self, job: outbox.Job) -> None:
        return None


def count_workers(started: list[int]) -> None:
    """Count in ``started[0]`` the worker threads started from now on."""
    start = threading.Thread.start

    def counted(thread: threading.Thread) -> None:
        if thread.name.startswith("outbox-worker"):
            started[0] += 1
        start(thread)

    threading.Thread.start = counted  # type: ignore[method-assign,assignment]


def main() -> None:
    dsn, schema, concurrency = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with psycopg.connect(dsn, autocommit=True) as conn:
        outbox.migrate(conn, schema=schema)
    dispatcher = outbox.Dispatcher(dsn, [Noop()], schema=schema, concurrency=concurrency)
    started = [0]
    count_workers(started)
    print("ready", outbox.__file__, flush=True)
    for rounds, line in enumerate(sys.stdin):
        jobs = int(line)
        if jobs:
            with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
                tx.enqueue_many([outbox.NewJob(NOOP, key=f"r{rounds}-{i}", payload={})
                                 for i in range(jobs)])
        started[0] = 0
        cpu, began = time.process_time(), time.perf_counter()
        stats = dispatcher.run_until_idle(timeout=60)
        wall = time.perf_counter() - began
        cpu = time.process_time() - cpu
        if stats.done != jobs:
            raise SystemExit(f"drained {stats.done} of {jobs}")
        print(f"{wall:.9f} {cpu:.9f} {started[0]}", flush=True)


if __name__ == "__main__":
    main()
