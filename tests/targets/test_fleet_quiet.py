"""Quiet databases past the look-outs' budget are not looked at: once their first turns
are over, rounds go by in which the polling look-out reads the server's counters
(``pg_stat_database``) on a kept connection and opens none, yet a job enqueued into one
of them is noticed by its counters and done, and a job enqueued to run later is looked
at again when it falls due: with ``quiet_look_interval`` at an hour, nothing else could
have found them. ``AsyncDispatcher``'s look-out does the same on its async pool. A
database behind a pooler is looked at every round, as before.
(Counted and awaited, never timed; the skip rule alone: tests/unit/test_looks.py.)"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from functools import partial
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import outbox
from outbox import AsyncDispatcher, Dispatcher, Effect, Job, Target
from outbox._dispatch.fleet import Fleet
from outbox._dispatch.looks import Counters, Identity, Seen, look, must_look, read_counters
from outbox._steps import execute, run
from outbox.observe import DispatchObserver

from ..operations import pgbouncer
from .support import Databases
from .test_fleet import wait_for

DATABASES = 6
BUDGET = 6  # two listening look-outs; the four other databases polled, one turn at once
QUIET_ROUNDS = 8  # rounds in a row with no look: the polled databases are quiet


class Done(Effect):
    """Sets an event per key performed."""

    name = "test.quiet"

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: dict[str, threading.Event] = {}

    def event(self, key: str) -> threading.Event:
        with self.lock:
            return self.events.setdefault(key, threading.Event())

    def perform(self, job: Job) -> None:
        self.event(job.key).set()


class FirstTurns(DispatchObserver):
    """``all_up`` once every target has ended a turn well."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.up: set[str] = set()
        self.lock = threading.Lock()
        self.all_up = threading.Event()

    def target_state(self, name: str, up: bool) -> None:
        with self.lock:
            if up:
                self.up.add(name)
            if len(self.up) >= self.count:
                self.all_up.set()


class Opened:
    """The dispatcher's connections opened, blocking and asyncio, by role."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_role: dict[str, int] = {}

    def count(self, kwargs: dict[str, Any], flavour: str) -> None:
        name = str(kwargs.get("application_name", ""))
        if name.startswith("outbox"):
            role = f"{flavour} {name.split()[1]}"
            with self.lock:
                self.by_role[role] = self.by_role.get(role, 0) + 1

    def total(self) -> int:
        with self.lock:
            return sum(self.by_role.values())

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return dict(self.by_role)


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> Iterator[Opened]:
    counts = Opened()
    connect, connect_async = psycopg.connect, psycopg.AsyncConnection.connect

    def counted(*args: Any, **kwargs: Any) -> Any:
        counts.count(kwargs, "sync")
        return connect(*args, **kwargs)

    async def counted_async(*args: Any, **kwargs: Any) -> Any:
        counts.count(kwargs, "async")
        return await connect_async(*args, **kwargs)

    monkeypatch.setattr(psycopg, "connect", counted)
    monkeypatch.setattr(psycopg.AsyncConnection, "connect", counted_async)
    yield counts


def polled_fleet(databases: Databases, kind: type[Dispatcher] | type[AsyncDispatcher],
                 ) -> tuple[Any, list[Target], Done, FirstTurns]:
    targets = sorted((Target(databases.make("outbox")) for _ in range(DATABASES)),
                     key=lambda t: t.dsn)
    effect, watch = Done(), FirstTurns(DATABASES)
    dispatcher = kind(effects=[effect], targets=targets, max_connections=BUDGET,
                      poll_interval=0.1, quiet_look_interval=timedelta(hours=1),
                      observer=watch)
    return dispatcher, targets, effect, watch


def fleet_of(dispatcher: Any) -> Fleet:
    fleet = dispatcher._fleet
    assert isinstance(fleet, Fleet)
    return fleet


def wait_quiet(fleet: Fleet, opened: Opened) -> None:
    """Until QUIET_ROUNDS rounds of the polling look-out in a row read the counters and
    looked at no database and opened no connection (the first turns' own writes reach
    the counters up to 10 s late, and bring one more look each)."""
    mark: list[tuple[int, int, int]] = []

    def quiet() -> bool:
        now = (fleet.looks, opened.total(), fleet.counter_reads)
        if not mark or now[:2] != mark[0][:2]:
            mark[:] = [now]
        return now[2] - mark[0][2] >= QUIET_ROUNDS

    wait_for(quiet, f"{QUIET_ROUNDS} quiet rounds")


def enqueue(target: Target, key: str, run_at: timedelta | None = None) -> None:
    with psycopg.connect(target.dsn) as conn, outbox.transaction(conn) as tx:
        tx.enqueue(Done.name, key=key, payload={}, run_at=run_at)


def serve(dispatcher: Any, targets: list[Target], effect: Done, watch: FirstTurns,
          opened: Opened, run: Callable[[], object]) -> tuple[int, dict[str, int]]:
    """Run the fleet; once quiet, one job into a quiet polled database, then one to run
    three seconds later into another: each done. The looks and the connections opened
    when every target had had its first turn."""
    fleet = fleet_of(dispatcher)
    runner = threading.Thread(target=run, name="test-runner")
    runner.start()
    try:
        assert watch.all_up.wait(120), f"only {len(watch.up)} targets served"
        at_first_turns = fleet.looks, opened.snapshot()
        polled = [t for t in targets if not any(
            s.persistent and t.dsn in key for key, s in fleet.scouts.items())]
        assert len(polled) == DATABASES - 2, polled
        wait_quiet(fleet, opened)
        skipped = fleet.skipped
        enqueue(polled[0], "now")
        assert effect.event("now").wait(120), "the job enqueued into a quiet database"
        wait_for(lambda: fleet.skipped > skipped, "the others skipped meanwhile")

        later = polled[1]
        enqueue(later, "later", run_at=timedelta(seconds=3))
        # Its enqueue moved the counters: a look found it not due yet, and remembered
        # when it is; nothing is written there until then.
        wait_for(lambda: (seen := fleet.seen.get(later.dsn)) is not None
                 and seen.next_due is not None, "the look that found the delayed job")
        assert effect.event("later").wait(120), "the delayed job"
    finally:
        dispatcher.stop()
        runner.join(60)
    assert not runner.is_alive()
    return at_first_turns


@pytest.mark.parametrize("kind", [Dispatcher, AsyncDispatcher])
def test_quiet_databases_are_skipped_and_their_work_is_still_noticed(
        databases: Databases, opened: Opened,
        kind: type[Dispatcher] | type[AsyncDispatcher]) -> None:
    dispatcher, targets, effect, watch = polled_fleet(databases, kind)
    fleet = fleet_of(dispatcher)

    def run() -> object:
        if isinstance(dispatcher, AsyncDispatcher):
            return asyncio.run(dispatcher.run())
        return dispatcher.run()

    looks, before = serve(dispatcher, targets, effect, watch, opened, run)
    # The polling look-out's looks since the first turns opened no connection of its
    # own: they took the turns' pool's, AsyncDispatcher's too (before, each of its
    # looks opened one).
    assert fleet.looks > looks
    assert opened.snapshot().get("sync scout", 0) == before.get("sync scout", 0), (
        before, opened.snapshot())


def test_a_commit_on_a_live_connection_shows_at_once_and_a_dispatchers_does_not(
        databases: Databases) -> None:
    # An application's kept connection that enqueues twice within a second holds its
    # second write's counters up to 10 s (PostgreSQL 15+); its state change is seen at
    # once. A dispatcher's own connections (``outbox <role> ...``: its looks and turns)
    # change nothing the look-out compares.
    target = Target(databases.make("outbox"))
    with (psycopg.connect(target.dsn, autocommit=True) as reader,
          psycopg.connect(target.dsn, autocommit=True) as app,
          psycopg.connect(target.dsn, autocommit=True,
                          application_name="outbox claimer test") as ours):
        identity = run(look(["outbox"], "{}"), partial(execute, reader)).identity
        assert identity is not None

        def current() -> dict[Identity, Counters]:
            return run(read_counters("outbox"), partial(execute, reader))

        for n in range(2):  # the first may flush the counters, the second is held
            with outbox.transaction(app) as tx:
                tx.enqueue(Done.name, key=f"warm-{n}", payload={})
        before = current()
        last = Seen(before[identity], at=0.0, next_due=None)
        ours.execute("SELECT count(*) FROM outbox.jobs")
        with outbox.transaction(ours) as tx:
            tx.enqueue(Done.name, key="by-a-dispatcher", payload={})
        # the application's last state change still the latest seen (the reader's own
        # is never counted)
        assert current()[identity].changed_at == last.counters.changed_at is not None
        before = current()
        last = Seen(before[identity], at=0.0, next_due=None)
        with outbox.transaction(app) as tx:
            tx.enqueue(Done.name, key="live", payload={})
        after = current()[identity]
        assert after.changed_at is not None and after.changed_at > last.counters.read_at
        assert must_look(last, {identity: after}, 1.0, every=3600)


def test_a_database_behind_a_pooler_is_looked_at_every_round(
        dsn: str, databases: Databases) -> None:
    # Through a pooler, the look's connection may reach any session of the pool: the
    # look-out never skips it, while the quiet databases reached directly are skipped.
    bouncer = pgbouncer.start(dsn)
    try:
        names = [databases.make("outbox") for _ in range(4)]

        def through_pooler(index: int) -> list[Target]:
            dbname = conninfo_to_dict(names[index])["dbname"]
            return [Target(make_conninfo(bouncer.dsn, dbname=dbname)),
                    *(Target(name) for n, name in enumerate(names) if n != index)]

        # The look-out listens on the first of the databases in the order of their
        # connection strings (a budget of 4 leaves one such slot); those are random
        # names: the pooled one is chosen so that it is not that first one.
        targets = next(ts for ts in map(through_pooler, range(len(names)))
                       if min(t.dsn for t in ts) != ts[0].dsn)
        pooled = targets[0]
        effect, watch = Done(), FirstTurns(len(targets))
        dispatcher = Dispatcher(effects=[effect], targets=targets, max_connections=4,
                                poll_interval=0.1, quiet_look_interval=timedelta(hours=1),
                                observer=watch)
        fleet = fleet_of(dispatcher)
        runner = threading.Thread(target=dispatcher.run, name="test-runner")
        runner.start()
        try:
            assert watch.all_up.wait(120), f"only {len(watch.up)} targets served"
            polled = [t for t in targets if not any(
                s.persistent and t.dsn in key for key, s in fleet.scouts.items())]
            assert pooled in polled and len(polled) == 3, polled
            direct = [t for t in polled if t is not pooled]
            wait_for(lambda: all(t.dsn in fleet.seen for t in direct), "the direct looks")
            skipped, looks = fleet.skipped, fleet.looks
            wait_for(lambda: fleet.skipped >= skipped + 10 * len(direct)
                     and fleet.looks >= looks + 10, "ten rounds")
            assert pooled.dsn not in fleet.seen  # never remembered: looked at each round
            with psycopg.connect(pooled.dsn, prepare_threshold=None) as conn, \
                    outbox.transaction(conn) as tx:
                tx.enqueue(Done.name, key="pooled", payload={})
            assert effect.event("pooled").wait(120), "the job enqueued through the pooler"
        finally:
            dispatcher.stop()
            runner.join(60)
        assert not runner.is_alive()
    finally:
        bouncer.stop()
