"""What a fleet's turns cost: threads started and connections opened per minute.

``python -m benchmarks.fleet [--dsn DSN] [--schemas 200] [--seconds 60] [--rate 5]
[--looks-only]``

One database holds ``--schemas`` migrated outbox schemas, a target each (or, with
``--databases``, as many databases, a target each: the fleet's tests use both layouts).
One process runs ``Dispatcher(effects=[noop], targets=[...], max_connections=16)`` (or,
with ``--async``, ``AsyncDispatcher``'s) with ``run()``, twice:

- ``each turn its own``: the fleet's former way (``Fleet.shared = False``), every turn a
  whole ``run_until_idle`` starting its threads and opening its connections;
- ``shared``: the turns run on the fleet's long-lived threads and take their connections
  from its pool (``outbox._dispatch.crew``), and its listening look-out asks every idle
  schema each round (``Fleet.skip_quiet_schemas = False``, as it did);
- ``asks when changed`` (schemas of one database): the same, the look-out asking only the
  schemas where something may have changed since their last look (``looks.must_ask``).
  With ``--looks-only``, these last two runs only.

With 200 schemas of one database and the default budget (16), that database has a
listening look-out (a budget leaves a look-out connection per database for at most half
of it); with ``--databases``, the first seven databases (in the order of their
connection strings) have one, the others are polled.

Each run first waits until every target has had its first turn (the observer's
``target_state``), then, for ``--seconds``, a feeder commits ``--rate`` jobs a second,
each in a schema drawn at random (the same seeded sequence for both runs), and counts
the threads the process starts whose name begins ``outbox`` (``threading.Thread.start``)
and the connections it opens whose ``application_name`` begins ``outbox``
(``psycopg.connect`` and ``psycopg.AsyncConnection.connect``): the dispatcher's, not
the feeder's; the look-outs' connections apart, and all of them together. A window of
60 seconds or more also holds every target's chores turn (``CHORES_EVERY``). Figures are per minute;
the ratio is shared over each-turn-its-own, measured in the same invocation.

The listening look-outs' asks are schemas asked (one statement each: ``looks.ask``),
counted by the fleet (``Fleet.asks``, ``Fleet.asks_skipped``); commit-to-done is given
for the jobs fed into listened schemas and into polled databases apart.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

import outbox
from outbox import AsyncDispatcher, Dispatcher, Target
from outbox.observe import DispatchObserver

from ._db import fresh_database, migrated, server, settle
from ._effects import NOOP, Noop, payload
from ._stats import percentile

log = logging.getLogger("benchmarks")


@dataclass
class Counts:
    """What the dispatcher started and opened during the measured window."""

    threads: int = 0
    connections: int = 0  # the turns' (claimer, recorder, ...)
    scout_connections: int = 0  # the look-outs' (the shared one opens one per look)
    jobs: int = 0
    seconds: float = 0.0
    looks: int = 0  # databases the polling look-out looked at
    skipped: int = 0  # ... and skipped: their server's counters stood still
    tasks: int = 0  # asyncio tasks started on AsyncDispatcher's loop
    asks: int = 0  # schemas the listening look-outs asked (a statement each)
    asks_skipped: int = 0  # ... and did not: nothing may have changed there
    # commit-to-done of the jobs fed into listened databases, seconds
    listened_done: list[float] = field(default_factory=list)
    # commit-to-done (the ledger's recorded_at less the job's created_at) of the jobs fed
    # into polled databases (past the look-outs' budget), seconds
    polled_done: list[float] = field(default_factory=list)

    @property
    def all_connections(self) -> int:
        return self.connections + self.scout_connections

    def per_minute(self, value: int) -> float:
        return value * 60.0 / self.seconds if self.seconds else 0.0


class _Counter:
    counting = False
    threads = 0
    tasks = 0
    connections = 0
    scout_connections = 0
    lock = threading.Lock()


@contextmanager
def _counting() -> Iterator[type[_Counter]]:
    """Count the dispatcher's thread starts and connection opens while counting is on."""
    start, connect = threading.Thread.start, psycopg.connect
    connect_async = psycopg.AsyncConnection.connect

    def counted_start(thread: threading.Thread) -> None:
        if _Counter.counting and thread.name.startswith("outbox"):
            with _Counter.lock:
                _Counter.threads += 1
        start(thread)

    def count(kwargs: dict[str, Any]) -> None:
        name = str(kwargs.get("application_name", ""))
        if _Counter.counting and name.startswith("outbox"):
            with _Counter.lock:
                if name.startswith("outbox scout"):
                    _Counter.scout_connections += 1
                else:
                    _Counter.connections += 1

    def counted_connect(*args: Any, **kwargs: Any) -> Any:
        count(kwargs)
        return connect(*args, **kwargs)

    async def counted_connect_async(*args: Any, **kwargs: Any) -> Any:
        count(kwargs)
        return await connect_async(*args, **kwargs)

    threading.Thread.start = counted_start  # type: ignore[method-assign, assignment]
    psycopg.connect = counted_connect
    psycopg.AsyncConnection.connect = counted_connect_async  # type: ignore[method-assign]
    try:
        yield _Counter
    finally:
        threading.Thread.start = start  # type: ignore[method-assign]
        psycopg.connect = connect
        psycopg.AsyncConnection.connect = connect_async  # type: ignore[method-assign]


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


async def _counting_tasks(dispatcher: AsyncDispatcher) -> None:
    """``dispatcher.run()``, counting the tasks its loop starts while counting is on."""
    loop = asyncio.get_running_loop()

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> Any:
        if _Counter.counting:
            with _Counter.lock:
                _Counter.tasks += 1
        return asyncio.Task(coro, loop=loop, **kwargs)

    loop.set_task_factory(factory)
    await dispatcher.run()


def measure(targets: list[Target], *, shared: bool, seconds: float, rate: float,
            seed: int, max_connections: int, flavour: str = "sync",
            share_looks: bool = True, skip_quiet: bool = True,
            skip_quiet_schemas: bool = True, tag: str = "") -> Counts:
    """One run of the fleet over ``targets``: the counts of the measured window."""
    watch = _FirstTurns(len(targets))
    kind = AsyncDispatcher if flavour == "async" else Dispatcher
    dispatcher = kind(effects=[Noop()], targets=targets, max_connections=max_connections,
                      observer=watch)
    assert dispatcher._fleet is not None
    dispatcher._fleet.shared = shared
    dispatcher._fleet.share_looks = share_looks
    dispatcher._fleet.skip_quiet = skip_quiet
    dispatcher._fleet.skip_quiet_schemas = skip_quiet_schemas
    if isinstance(dispatcher, AsyncDispatcher):
        runner = threading.Thread(target=asyncio.run, args=(_counting_tasks(dispatcher),),
                                  name="bench-fleet")
    else:
        runner = threading.Thread(target=dispatcher.run, name="bench-fleet")
    counts = Counts()
    draw = random.Random(seed)
    with _counting() as counter:
        runner.start()
        try:
            if not watch.all_up.wait(600):
                raise RuntimeError(f"only {len(watch.up)} of {len(targets)} targets served "
                                   "within 600 s")
            counter.threads = counter.connections = counter.scout_connections = 0
            counter.tasks = 0
            looks, skipped = dispatcher._fleet.looks, dispatcher._fleet.skipped
            asks, asks_skipped = dispatcher._fleet.asks, dispatcher._fleet.asks_skipped
            listened = {dsn for key, scout in dispatcher._fleet.scouts.items()
                        if scout.persistent for dsn in key}
            counter.counting = True
            began = time.monotonic()
            feeders: dict[str, psycopg.Connection[Any]] = {}
            try:
                n = 0
                while (now := time.monotonic()) - began < seconds:
                    target = draw.choice(targets)
                    if target.dsn not in feeders:
                        feeders[target.dsn] = psycopg.connect(target.dsn, autocommit=True)
                    with outbox.transaction(feeders[target.dsn], schema=target.schema) as tx:
                        tx.enqueue(NOOP, key=f"{tag}-{n}", payload=payload(n))
                    n += 1
                    time.sleep(max(0.0, began + n / rate - time.monotonic()))
            finally:
                for feeder in feeders.values():
                    feeder.close()
            counter.counting = False
            counts.seconds = now - began
            counts.threads, counts.connections, counts.jobs = (
                counter.threads, counter.connections, n)
            counts.scout_connections = counter.scout_connections
            counts.looks = dispatcher._fleet.looks - looks
            counts.skipped = dispatcher._fleet.skipped - skipped
            counts.asks = dispatcher._fleet.asks - asks
            counts.asks_skipped = dispatcher._fleet.asks_skipped - asks_skipped
            counts.tasks = counter.tasks
            polled = [t for t in targets if t.dsn not in listened]
            counts.polled_done = _commit_to_done(targets, polled, tag, n)
            counts.listened_done = _commit_to_done(
                targets, [t for t in targets if t.dsn in listened], tag, n)
        finally:
            counter.counting = False
            dispatcher.stop()
            runner.join(120)
    return counts


def _commit_to_done(targets: list[Target], polled: list[Target], tag: str,
                    fed: int) -> list[float]:
    """Once every job fed is done (at most 300 s), the commit-to-done of those fed into
    ``polled``: the ledger's ``recorded_at`` less the job's ``created_at`` (the server's
    clock, both)."""
    like = f"{tag}-%"
    deadline = time.monotonic() + 300
    while _done(targets, like) < fed:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {_done(targets, like)} of {fed} jobs done in 300 s")
        time.sleep(1.0)
    found: list[float] = []
    for target in polled:
        with psycopg.connect(target.dsn, autocommit=True) as conn:
            rows = conn.execute(sql.SQL(
                "SELECT extract(epoch FROM r.recorded_at - j.created_at)::float8 "
                "FROM {schema}.jobs j JOIN {schema}.effect_results r ON r.key = j.key "
                "WHERE j.key LIKE %s").format(schema=sql.Identifier(target.schema)),
                (like,)).fetchall()
        found.extend(float(r[0]) for r in rows)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fleet", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dsn", help="a server to use (needs CREATEDB); default: embedded")
    parser.add_argument("--schemas", type=int, default=200, help="targets: schemas of one "
                        "database (the default), or databases with --databases")
    parser.add_argument("--databases", action="store_true",
                        help="each target a database of its own (schema outbox)")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--rate", type=float, default=5.0, help="jobs committed a second")
    parser.add_argument("--max-connections", type=int, default=16)
    parser.add_argument("--seed", type=int, default=46)
    parser.add_argument("--async", dest="flavour", action="store_const", const="async",
                        default="sync", help="AsyncDispatcher's fleet (turns as tasks)")
    parser.add_argument("--looks-only", action="store_true", help="only the runs looking "
                        "every round and skipping quiet ones: with --databases, polled "
                        "looks and the counters read first; else the listening "
                        "look-out's asks")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    width = max(3, len(str(args.schemas - 1)))
    names = [f"t{n:0{width}d}" for n in range(args.schemas)]
    connections = 2 * args.max_connections + 50 + (args.schemas if args.databases else 0)
    settings = {"max_connections": str(max(100, connections))}
    with server(args.dsn, settings) as srv, contextlib.ExitStack() as made:
        began = time.monotonic()
        if args.databases:
            targets = []
            for name in names:
                dsn = made.enter_context(fresh_database(srv, f"fleet_{name}"))
                migrated(dsn)
                settle(dsn)
                targets.append(Target(dsn))
        else:
            dsn = made.enter_context(fresh_database(srv, "fleet"))
            for name in names:
                migrated(dsn, name)
            settle(dsn)
            targets = [Target(dsn, name) for name in names]
        layout = "databases" if args.databases else "schemas of one database"
        kind = "AsyncDispatcher" if args.flavour == "async" else "Dispatcher"
        print(f"{args.schemas} targets ({layout}) migrated in {time.monotonic() - began:.0f} s; "
              f"{kind}, window {args.seconds:g} s, {args.rate:g} jobs/s, "
              f"max_connections={args.max_connections}", flush=True)
        # (label, shared, share_looks, skip_quiet, skip_quiet_schemas). Past the
        # look-outs' budget (databases only): the turns' pool shared with the looks or
        # apart from them (Dispatcher's), then every polled database looked at each round
        # as before (AsyncDispatcher's looks apart, as they were) against the counters
        # read first. Schemas of one database (listened): every idle schema asked each
        # round as before, against only those where something may have changed.
        runs = [("each turn its own", False, False, False, False)]
        if not args.databases:
            runs += [("shared", True, True, True, False),
                     ("asks when changed", True, True, True, True)]
        else:
            if args.flavour == "sync":
                runs.append(("looks apart", True, False, False, True))
            runs += [("looks every round", True, args.flavour == "sync", False, True),
                     ("counters first", True, True, True, True)]
        if args.looks_only:
            runs = runs[-2:]
        results = {}
        for n, (label, shared, share_looks, skip_quiet, skip_schemas) in enumerate(runs):
            results[label] = measure(targets, shared=shared, seconds=args.seconds,
                                     rate=args.rate, seed=args.seed,
                                     max_connections=args.max_connections,
                                     flavour=args.flavour, share_looks=share_looks,
                                     skip_quiet=skip_quiet,
                                     skip_quiet_schemas=skip_schemas, tag=f"r{n}")
            print(f"  {label}: {results[label].jobs} jobs fed, {_done(targets)} done so far",
                  flush=True)
    _table(results)
    return 0


def _table(results: dict[str, Counts]) -> None:
    """Per minute, each run's counts, then each later run's ratio to the one before."""
    labels = list(results)
    print()
    print(f"{'per minute':<22}" + "".join(f"{label:>20}" for label in labels)
          + "".join(f"{f'ratio {n + 1}/{n}':>10}" for n in range(1, len(labels))))
    rows = (("threads", "threads started"), ("tasks", "tasks started"),
            ("connections", "connections opened"),
            ("scout_connections", "look-out connections"), ("all_connections", "all connections"),
            ("looks", "polled looks"), ("skipped", "skipped looks"),
            ("asks", "listened asks"), ("asks_skipped", "skipped asks"))
    for what, label in rows:
        values = [results[name].per_minute(getattr(results[name], what)) for name in labels]
        ratios = "".join(f"{f'{v / b:.3f}' if b else '-':>10}"
                         for b, v in itertools.pairwise(values))
        print(f"{label:<22}" + "".join(f"{v:>20.0f}" for v in values) + ratios)
    # The polled looks' number follows how fast a round of them goes (the machine, its
    # load): connections per look compares runs whatever their pace.
    per_look = [results[n].all_connections / results[n].looks if results[n].looks else 0.0
                for n in labels]
    if any(per_look):
        print(f"{'connections per look':<22}" + "".join(f"{v:>20.2f}" for v in per_look)
              + "".join(f"{f'{v / b:.3f}' if b else '-':>10}"
                        for b, v in itertools.pairwise(per_look)))
    # Not per minute: how long a job fed into a polled database (a listened one) took
    # to be done.
    for where, attribute in (("polled databases", "polled_done"),
                             ("listened databases", "listened_done")):
        done = [getattr(results[n], attribute) for n in labels]
        if not any(done):
            continue
        print(f"commit-to-done of the jobs fed into {where}, seconds:")
        for q, name in ((0.5, "p50"), (0.95, "p95"), (1.0, "max")):
            values = [percentile(found, q) for found in done]
            print(f"{'  ' + name:<22}" + "".join(f"{v:>20.2f}" for v in values)
                  + "".join(f"{f'{v / b:.3f}' if b else '-':>10}"
                            for b, v in itertools.pairwise(values)))
        print(f"{'  jobs':<22}" + "".join(f"{len(found):>20}" for found in done))


def _done(targets: list[Target], like: str = "%") -> int:
    """Ledger rows over every target (whose key is ``like``): the jobs done so far."""
    total = 0
    for target in targets:
        with psycopg.connect(target.dsn, autocommit=True) as conn:
            row = conn.execute(sql.SQL("SELECT count(*) FROM {}.effect_results "
                                       "WHERE key LIKE %s").format(
                sql.Identifier(target.schema)), (like,)).fetchone()
        total += int(row[0]) if row else 0
    return total


if __name__ == "__main__":
    raise SystemExit(main())
