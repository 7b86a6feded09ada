"""Databases past the look-outs' budget are polled on the fleet's pool: a look at a
database with recent work uses the connection its turns keep, and the turn a look wakes
takes the connection the look used, so a busy polled database is looked at and served
without a connection opened per look; the budget still holds (counted, never timed)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from outbox import Dispatcher, Target

from .support import Databases, Recorded, enqueue
from .test_fleet import wait_for

DATABASES = 8
BUDGET = 6  # two listening look-outs, one polling the six other databases, one turn
ROUNDS = 5


class ByDatabase:
    """The dispatcher's connections opened, per database name, and the most it held
    open at once (sampled on the client: a closed connection's backend may linger a
    moment on the server, past what the dispatcher holds)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.opened: dict[str, int] = {}
        self.made: list[psycopg.Connection[Any]] = []
        self.most = 0
        self.stopping = threading.Event()

    def sample(self) -> None:
        while not self.stopping.wait(0.002):
            with self.lock:
                held = sum(not conn.closed for conn in self.made)
            self.most = max(self.most, held)


@pytest.fixture
def by_database(monkeypatch: pytest.MonkeyPatch) -> Iterator[ByDatabase]:
    counts = ByDatabase()
    connect = psycopg.connect

    def counted(conninfo: str = "", *args: Any, **kwargs: Any) -> Any:
        if str(kwargs.get("application_name", "")).startswith("outbox"):
            name = str(conninfo_to_dict(conninfo).get("dbname"))
            conn = connect(conninfo, *args, **kwargs)
            with counts.lock:
                counts.opened[name] = counts.opened.get(name, 0) + 1
                counts.made.append(conn)
            return conn
        return connect(conninfo, *args, **kwargs)

    monkeypatch.setattr(psycopg, "connect", counted)
    sampler = threading.Thread(target=counts.sample, daemon=True)
    sampler.start()
    yield counts
    counts.stopping.set()
    sampler.join()


def test_a_busy_polled_database_is_looked_at_and_served_on_kept_connections(
        dsn: str, databases: Databases, by_database: ByDatabase) -> None:
    targets = sorted((Target(databases.make("outbox")) for _ in range(DATABASES)),
                     key=lambda t: t.dsn)
    busy = targets[-1]  # past the listening look-outs (given to the first by name)
    busy_name = str(conninfo_to_dict(busy.dsn)["dbname"])
    effect = Recorded()
    dispatcher = Dispatcher(effects=[effect], targets=targets, max_connections=BUDGET,
                            poll_interval=0.1)
    # Every polled database looked at each round, whatever its counters say (skipping
    # the quiet ones: test_fleet_quiet): the pool under the looks' pressure.
    assert dispatcher._fleet is not None
    dispatcher._fleet.skip_quiet = False
    runner = threading.Thread(target=dispatcher.run, name="test-runner")
    runner.start()
    try:
        enqueue(busy, 1)
        wait_for(lambda: len(effect.performed) == 1, "the first job")
        with by_database.lock:
            before = dict(by_database.opened)
        looks_before = sum(before.values()) - before.get(busy_name, 0)
        for n in range(1, ROUNDS):
            enqueue(busy, 1, first=n)
            wait_for(lambda: len(effect.performed) == n + 1,  # noqa: B023 - waited here
                     f"round {n + 1}'s job")
        # The other polled databases were looked at meanwhile (each look opening a
        # connection: they have no recent work), many times over.
        with by_database.lock:
            after = dict(by_database.opened)
        wait_for(lambda: sum(by_database.opened.values()) - by_database.opened.get(
            busy_name, 0) >= looks_before + 2 * (DATABASES - 2), "the idle ones' looks")
    finally:
        dispatcher.stop()
        runner.join(60)
    assert not runner.is_alive()
    assert set(effect.performed.values()) == {1}
    # Looked at every poll interval and served four times, the busy database got no
    # new connection: its looks and its turns used the ones kept for it (one look
    # racing a turn for its connection may open one).
    assert after.get(busy_name, 0) - before.get(busy_name, 0) <= 1, (before, after)
    assert by_database.most <= BUDGET, by_database.most
