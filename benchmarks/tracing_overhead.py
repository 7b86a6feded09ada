"""What tracing costs: enqueue and the per-job hooks with no tracer provider (the
default), and with an SDK provider recording every span (no exporter), in one process
(``python -m benchmarks.tracing_overhead``).

A tracer provider can be set once per process, so the untraced phases run first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import psycopg

import outbox
from outbox import tracing

from ._db import fresh_database, migrated, server


def _enqueue_ms(dsn: str, transactions: int, rounds: int, tag: str) -> float:
    """Median over ``rounds`` of the mean ms per transaction holding one ``tx.enqueue``."""
    times = []
    with psycopg.connect(dsn) as conn:
        for r in range(rounds):
            started = time.perf_counter()
            for i in range(transactions):
                with outbox.transaction(conn) as tx:
                    tx.enqueue("bench.noop", key=f"{tag}-{r}-{i}", payload={"n": i})
            times.append(1000 * (time.perf_counter() - started) / transactions)
    return statistics.median(times)


def _per_call_ns(call: Callable[[], object], n: int = 200_000) -> float:
    started = time.perf_counter()
    for _ in range(n):
        call()
    return 1e9 * (time.perf_counter() - started) / n


def _hooks_ns() -> float:
    """The traced per-job work: the attempt span, then its settle event and end."""
    def one() -> None:
        span = tracing.attempt_span(1, "bench.noop", 1, None)
        tracing.settle(span, "bench.noop", "done")
    return _per_call_ns(one, 20_000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--transactions", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dsn", default=None)
    args = parser.parse_args()
    assert "opentelemetry.trace" not in sys.modules
    with server(args.dsn) as srv, fresh_database(srv, "tracing") as dsn:
        migrated(dsn)
        rows = []
        rows.append(("tracing.enabled(), OpenTelemetry not imported",
                     f"{_per_call_ns(tracing.enabled):.0f} ns"))
        plain = _enqueue_ms(dsn, args.transactions, args.rounds, "plain")
        rows.append(("tx.enqueue per transaction, not imported", f"{plain:.3f} ms"))
        from opentelemetry import trace

        rows.append(("tracing.enabled(), imported, no provider",
                     f"{_per_call_ns(tracing.enabled):.0f} ns"))
        imported = _enqueue_ms(dsn, args.transactions, args.rounds, "imported")
        rows.append(("tx.enqueue per transaction, imported, no provider",
                     f"{imported:.3f} ms"))
        from opentelemetry.sdk.trace import TracerProvider

        trace.set_tracer_provider(TracerProvider())
        traced = _enqueue_ms(dsn, args.transactions, args.rounds, "traced")
        rows.append(("tx.enqueue per transaction, SDK provider, spans recorded",
                     f"{traced:.3f} ms"))
        rows.append(("attempt span + settle per job, SDK provider", f"{_hooks_ns():.0f} ns"))
    for name, value in rows:
        print(f"{name:<60} {value:>12}")


if __name__ == "__main__":
    main()
