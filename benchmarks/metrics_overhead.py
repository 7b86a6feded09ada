"""What metrics and tracing cost the drain: the outbox drain with and without them,
interleaved in one run on one server (``python -m benchmarks.metrics_overhead``).

Each variant drains the same number of no-op jobs in a fresh database; the variants
alternate so that load from elsewhere on the machine falls on both alike. Prints the
median and min..max jobs/s of each and the overhead of the medians.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from dataclasses import replace

from . import _drain_workers as workers
from ._db import server
from .drain import DrainConfig, measure

VARIANTS = {
    "plain": {},
    "metrics=True": {"metrics": True},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--procs", type=int, default=1)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dsn", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    base = DrainConfig(sizes=(args.jobs,), procs=(args.procs,), runs=1, systems=("outbox",))
    rates: dict[str, list[float]] = {name: [] for name in VARIANTS}
    with server(args.dsn) as srv:
        for _ in range(args.runs):
            for name, options in VARIANTS.items():
                config = replace(base, outbox=workers.OutboxSettings(options=dict(options)))
                run = measure(srv, config, "outbox", args.jobs, args.procs)
                rates[name].append(run.jobs_per_second)
                print(f"{name:<14} {run.jobs_per_second:>9,.0f} jobs/s", flush=True)
    plain = statistics.median(rates["plain"])
    for name, found in rates.items():
        median = statistics.median(found)
        # Pairs ran back to back: their ratio is less exposed to load that comes and goes.
        paired = statistics.median(p / m for p, m in zip(rates["plain"], found, strict=True))
        print(f"{name:<14} median {median:>9,.0f} jobs/s (min {min(found):,.0f}, max "
              f"{max(found):,.0f}); {100 * (plain - median) / plain:+.1f} % slower than plain;"
              f" median of paired ratios {100 * (paired - 1):+.1f} %")
    per_job = observer_cost()
    print(f"PrometheusObserver events cost {per_job * 1e6:.2f} us per job (one thread); "
          f"at the plain median that is {100 * per_job * plain:.1f} % of one core's time "
          "per job")


def observer_cost(jobs: int = 200_000, batch: int = 500) -> float:
    """CPU seconds the observer's events take per job: one claim per ``batch`` jobs, then
    each job's start and finish."""
    from prometheus_client import CollectorRegistry

    from outbox.metrics import PrometheusObserver

    observer = PrometheusObserver(CollectorRegistry())
    waits = [("bench.noop", 0.01)] * batch
    started = time.process_time()
    for _ in range(jobs // batch):
        observer.claimed(0.002, waits)
        for _ in range(batch):
            observer.attempt_started("bench.noop")
            observer.attempt_finished("bench.noop", "done", 0.0001)
    return (time.process_time() - started) / jobs


if __name__ == "__main__":
    main()
