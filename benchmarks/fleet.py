"""What a fleet's turns cost: threads started and connections opened per minute.

``python -m benchmarks.fleet [--dsn DSN] [--schemas 200] [--seconds 60] [--rate 5]``

One database holds ``--schemas`` migrated outbox schemas (the fleet's tests' layout: a
target per schema). One process runs ``Dispatcher(effects=[noop],
targets=outbox.targets.schemas(dsn), max_connections=16)`` with ``run()``, twice:

- ``each turn its own``: the fleet's former way (``Fleet.shared = False``), every turn a
  whole ``run_until_idle`` starting its threads and opening its connections;
- ``shared``: the turns run on the fleet's long-lived threads and take their connections
  from its pool (``outbox._dispatch.crew``).

Each run first waits until every target has had its first turn (the observer's
``target_state``), then, for ``--seconds``, a feeder commits ``--rate`` jobs a second,
each in a schema drawn at random (the same seeded sequence for both runs), and counts
the threads the process starts whose name begins ``outbox`` (``threading.Thread.start``)
and the connections it opens whose ``application_name`` begins ``outbox``
(``psycopg.connect``): the dispatcher's, not the feeder's. A window of 60 seconds or
more also holds every target's chores turn (``CHORES_EVERY``). Figures are per minute;
the ratio is shared over each-turn-its-own, measured in the same invocation.
"""

from __future__ import annotations

import argparse
import logging
import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

import outbox
from outbox import Dispatcher
from outbox.observe import DispatchObserver

from ._db import fresh_database, migrated, server, settle
from ._effects import NOOP, Noop, payload

log = logging.getLogger("benchmarks")


@dataclass
class Counts:
    """What the dispatcher started and opened during the measured window."""

    threads: int = 0
    connections: int = 0
    jobs: int = 0
    seconds: float = 0.0

    def per_minute(self, value: int) -> float:
        return value * 60.0 / self.seconds if self.seconds else 0.0


class _Counter:
    counting = False
    threads = 0
    connections = 0
    lock = threading.Lock()


@contextmanager
def _counting() -> Iterator[type[_Counter]]:
    """Count the dispatcher's thread starts and connection opens while counting is on."""
    start, connect = threading.Thread.start, psycopg.connect

    def counted_start(thread: threading.Thread) -> None:
        if _Counter.counting and thread.name.startswith("outbox"):
            with _Counter.lock:
                _Counter.threads += 1
        start(thread)

    def counted_connect(*args: Any, **kwargs: Any) -> Any:
        if _Counter.counting and str(kwargs.get("application_name", "")).startswith("outbox"):
            with _Counter.lock:
                _Counter.connections += 1
        return connect(*args, **kwargs)

    threading.Thread.start = counted_start  # type: ignore[method-assign, assignment]
    psycopg.connect = counted_connect
    try:
        yield _Counter
    finally:
        threading.Thread.start = start  # type: ignore[method-assign]
        psycopg.connect = connect


class _FirstTurns(DispatchObserver):
    """Sets ``all_up`` once every target has ended a turn well."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.up: set[str] = set()
        self.all_up = threading.Event()
        self.lock = threading.Lock()

    def target_state(self, name: str, up: bool) -> None:
        with self.lock:
            if up:
                self.up.add(name)
            if len(self.up) >= self.count:
                self.all_up.set()


def measure(dsn: str, names: list[str], *, shared: bool, seconds: float, rate: float,
            seed: int, max_connections: int) -> Counts:
    """One run of the fleet over ``names``: the counts of the measured window."""
    watch = _FirstTurns(len(names))
    dispatcher = Dispatcher(effects=[Noop()], targets=outbox.targets.schemas(dsn),
                            max_connections=max_connections, observer=watch)
    assert dispatcher._fleet is not None
    dispatcher._fleet.shared = shared
    runner = threading.Thread(target=dispatcher.run, name="bench-fleet")
    counts = Counts()
    draw = random.Random(seed)
    with _counting() as counter:
        runner.start()
        try:
            if not watch.all_up.wait(600):
                raise RuntimeError(f"only {len(watch.up)} of {len(names)} targets served "
                                   "within 600 s")
            counter.threads = counter.connections = 0
            counter.counting = True
            began = time.monotonic()
            with psycopg.connect(dsn, autocommit=True) as feeder:
                n = 0
                while (now := time.monotonic()) - began < seconds:
                    schema = draw.choice(names)
                    with outbox.transaction(feeder, schema=schema) as tx:
                        tx.enqueue(NOOP, key=f"{'s' if shared else 'e'}-{n}", payload=payload(n))
                    n += 1
                    time.sleep(max(0.0, began + n / rate - time.monotonic()))
            counter.counting = False
            counts.seconds = now - began
            counts.threads, counts.connections, counts.jobs = (
                counter.threads, counter.connections, n)
        finally:
            counter.counting = False
            dispatcher.stop()
            runner.join(120)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fleet", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dsn", help="a server to use (needs CREATEDB); default: embedded")
    parser.add_argument("--schemas", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--rate", type=float, default=5.0, help="jobs committed a second")
    parser.add_argument("--max-connections", type=int, default=16)
    parser.add_argument("--seed", type=int, default=46)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    width = max(3, len(str(args.schemas - 1)))
    names = [f"t{n:0{width}d}" for n in range(args.schemas)]
    settings = {"max_connections": str(max(100, 2 * args.max_connections + 50))}
    with server(args.dsn, settings) as srv, fresh_database(srv, "fleet") as dsn:
        began = time.monotonic()
        for name in names:
            migrated(dsn, name)
        settle(dsn)
        print(f"{args.schemas} schemas migrated in {time.monotonic() - began:.0f} s; "
              f"window {args.seconds:g} s, {args.rate:g} jobs/s, "
              f"max_connections={args.max_connections}", flush=True)
        results = {}
        for label, shared in (("each turn its own", False), ("shared", True)):
            results[label] = measure(dsn, names, shared=shared, seconds=args.seconds,
                                     rate=args.rate, seed=args.seed,
                                     max_connections=args.max_connections)
            done = _done(dsn, names)
            print(f"  {label}: {results[label].jobs} jobs fed, {done} done so far", flush=True)
    before, after = results["each turn its own"], results["shared"]
    print()
    print(f"{'per minute':<22}{'each turn its own':>20}{'shared':>12}{'ratio':>10}")
    for what in ("threads", "connections"):
        b = before.per_minute(getattr(before, what))
        a = after.per_minute(getattr(after, what))
        ratio = f"{a / b:.3f}" if b else "-"
        print(f"{what + ' ' + ('started' if what == 'threads' else 'opened'):<22}"
              f"{b:>20.0f}{a:>12.0f}{ratio:>10}")
    return 0


def _done(dsn: str, names: list[str]) -> int:
    query = sql.SQL(" + ").join(
        sql.SQL("(SELECT count(*) FROM {}.effect_results)").format(sql.Identifier(name))
        for name in names)
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(sql.SQL("SELECT ") + query).fetchone()
    return int(row[0]) if row else 0


if __name__ == "__main__":
    raise SystemExit(main())
