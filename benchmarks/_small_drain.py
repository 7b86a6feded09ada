"""One side of ``python -m benchmarks.drain_threads --small``: a process that times small
``run_until_idle`` drains of whichever ``outbox`` its ``PYTHONPATH`` finds.

Run as a script (``python benchmarks/_small_drain.py DSN SCHEMA CONCURRENCY``), not as a
module of the benchmarks package, so that the ``outbox`` it imports can be another
checkout's: it uses only the public API that every version has (``migrate``,
``transaction``, ``enqueue_many``, ``Dispatcher``). It prints ``ready <outbox's path>``,
then answers each line ``N`` read from stdin (enqueue ``N`` no-op jobs, then drain them
with one ``run_until_idle`` of the same dispatcher every round) with
``<wall seconds> <process CPU seconds>`` of the drain alone; it ends at end of input.
"""

from __future__ import annotations

import sys
import time

import psycopg

import outbox

NOOP = "bench.noop"


class Noop(outbox.Effect):
    name = NOOP

    def perform(self, job: outbox.Job) -> None:
        return None


def main() -> None:
    dsn, schema, concurrency = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with psycopg.connect(dsn, autocommit=True) as conn:
        outbox.migrate(conn, schema=schema)
    dispatcher = outbox.Dispatcher(dsn, [Noop()], schema=schema, concurrency=concurrency)
    print("ready", outbox.__file__, flush=True)
    for rounds, line in enumerate(sys.stdin):
        jobs = int(line)
        if jobs:
            with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
                tx.enqueue_many([outbox.NewJob(NOOP, key=f"r{rounds}-{i}", payload={})
                                 for i in range(jobs)])
        cpu, started = time.process_time(), time.perf_counter()
        stats = dispatcher.run_until_idle(timeout=60)
        wall = time.perf_counter() - started
        cpu = time.process_time() - cpu
        if stats.done != jobs:
            raise SystemExit(f"drained {stats.done} of {jobs}")
        print(f"{wall:.9f} {cpu:.9f}", flush=True)


if __name__ == "__main__":
    main()
