"""One dispatcher over many targets against real PostgreSQL: databases and schemas served
together within a connection budget, a target added while running, and a database that
refuses connections isolated from the others."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import Counter

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

import outbox
from outbox import Dispatcher, Target
from outbox.errors import ConfigurationError
from outbox.targets import parse_target, schemas

from .support import Databases, Recorded, enqueue, statuses


class ConnectionWatch:
    """Samples the server's backends in the given databases, keeping the most seen."""

    def __init__(self, dsn: str, databases: list[str]) -> None:
        self.dsn = dsn
        self.databases = databases
        self.most = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self.stopping.is_set():
                row = conn.execute("SELECT count(*) FROM pg_stat_activity "
                                   "WHERE datname = ANY(%s) AND backend_type = 'client backend'",
                                   (self.databases,)).fetchone()
                self.most = max(self.most, row[0] if row else 0)
                self.stopping.wait(0.01)

    def __enter__(self) -> ConnectionWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join()


def wait_for(predicate: object, what: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_one_dispatcher_serves_databases_and_schemas_within_its_budget(
    dsn: str, databases: Databases,
) -> None:
    # Two databases, three schemas in a third; 200 jobs each.
    first, second = databases.make("outbox"), databases.make("outbox")
    shared = databases.make("tenant_a", "tenant_b", "tenant_c")
    targets = [Target(first), Target(second), *(Target(shared, s) for s in
                                                 ("tenant_a", "tenant_b", "tenant_c"))]
    for target in targets:
        enqueue(target, 200)
    current = list(targets)
    effect = Recorded()
    dispatcher = Dispatcher(effects=[effect], targets=lambda: list(current),
                            targets_interval=0.5, max_connections=16, poll_interval=0.2)
    watched = list(databases.names)
    with ConnectionWatch(dsn, watched) as watch:
        runner = threading.Thread(target=dispatcher.run)
        runner.start()
        try:
            wait_for(lambda: len(effect.performed) >= 1000, "the first 1,000 jobs")
            # A sixth target, added through the callable while running.
            with psycopg.connect(shared, autocommit=True) as conn:
                outbox.migrate(conn, schema="tenant_d")
            added = Target(shared, "tenant_d")
            enqueue(added, 100)
            current.append(added)
            wait_for(lambda: statuses(added) == Counter(done=100), "the added target's jobs")
            # The second database now refuses connections: the others go on.
            with psycopg.connect(dsn, autocommit=True) as admin:
                name = databases.names[1]
                admin.execute(sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS false").format(
                    sql.Identifier(name)))
                admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                              "WHERE datname = %s", (name,))
            enqueue(targets[0], 50, first=200)  # more work for a live target after it
            late = {f"{targets[0].name}/{i}" for i in range(200, 250)}
            wait_for(lambda: late <= set(effect.performed), "the live target's later jobs")
        finally:
            dispatcher.stop()
            runner.join(60)
    assert not runner.is_alive()
    assert max(effect.performed.values()) == 1, "a job was performed twice"
    for target in [targets[0], *targets[2:], added]:
        assert statuses(target) == Counter(done=250 if target == targets[0] else
                                           100 if target == added else 200), target
    assert watch.most <= 16, watch.most


def test_a_target_missing_its_schema_is_isolated(dsn: str, databases: Databases,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    good = databases.make("outbox")
    missing = Target(good, "not_migrated")
    enqueue(Target(good), 20)
    effect = Recorded()
    states: list[tuple[str, bool]] = []

    class Watch(outbox.observe.DispatchObserver):
        def target_state(self, target: str, up: bool) -> None:
            states.append((target, up))

    with caplog.at_level("WARNING", logger="outbox.dispatcher"):
        stats = Dispatcher(effects=[effect], targets=[Target(good), missing],
                           observer=Watch()).run_until_idle(timeout=60)
    assert stats.done == 20 and len(effect.performed) == 20
    assert (missing.name, False) in states and (Target(good).name, True) in states
    assert any(missing.name in r.getMessage() and "failed" in r.getMessage()
               for r in caplog.records)


def test_the_async_dispatcher_serves_targets_too(dsn: str, databases: Databases) -> None:
    shared = databases.make("t1", "t2")
    targets = [Target(shared, "t1"), Target(shared, "t2")]
    for target in targets:
        enqueue(target, 30)
    effect = Recorded()
    stats = asyncio.run(outbox.AsyncDispatcher(effects=[effect], targets=targets)
                        .run_until_idle(timeout=60))
    assert stats.done == 60 and max(effect.performed.values()) == 1


def test_schemas_lists_every_outbox_of_a_database(dsn: str, databases: Databases) -> None:
    shared = databases.make("b_tenant", "a_tenant")
    with psycopg.connect(shared, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA unrelated")
    assert [t.schema for t in schemas(shared)] == ["a_tenant", "b_tenant"]


def test_a_target_never_shows_its_password() -> None:
    target = Target("postgresql://shop:s3cret@db.example:5433/shop", "tenant_7")
    assert target.name == "shop@db.example:5433#tenant_7"
    assert "s3cret" not in repr(target) and "s3cret" not in target.name
    assert parse_target("postgresql://shop:s3cret@db.example/shop#tenant_7") == Target(
        "postgresql://shop:s3cret@db.example/shop", "tenant_7")
    assert parse_target("host=db dbname=shop").schema == "outbox"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({}, "neither"),
    ({"conninfo": "dbname=x", "targets": []}, "not both"),
    ({"targets": "dbname=x"}, "list of outbox.Target"),
    ({"targets": [Target("dbname=x")], "max_connections": 2}, "max_connections"),
    ({"targets": [Target("dbname=x")], "targets_interval": 0}, "targets_interval"),
])
def test_wrong_target_options_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        Dispatcher(effects=[Recorded()], **kwargs)  # type: ignore[arg-type]


def test_a_connection_string_that_does_not_parse_is_not_repeated() -> None:
    with pytest.raises(ConfigurationError) as raised:
        Target("postgresql://u:s3cret@[bad/x")
    assert "s3cret" not in str(raised.value)


def test_a_target_behind_on_its_migrations_waits_and_is_served_once_migrated(
    dsn: str, databases: Databases,
) -> None:
    shared = databases.make("current")
    with psycopg.connect(shared, autocommit=True) as conn:
        outbox.migrate(conn, schema="behind", target=11)  # one migration short
    current, behind = Target(shared, "current"), Target(shared, "behind")
    enqueue(current, 10)
    effect = Recorded()
    states: list[tuple[str, bool]] = []

    class Watch(outbox.observe.DispatchObserver):
        def target_state(self, target: str, up: bool) -> None:
            states.append((target, up))

    dispatcher = Dispatcher(effects=[effect], targets=[current, behind], observer=Watch(),
                            poll_interval=0.1)
    runner = threading.Thread(target=dispatcher.run)
    runner.start()
    try:
        wait_for(lambda: (behind.name, False) in states and len(effect.performed) == 10,
                 "the current target served and the one behind reported")
        with psycopg.connect(shared, autocommit=True) as conn:
            outbox.migrate(conn, schema="behind")
        enqueue(behind, 5)
        # retried with backoff (1 s, 2 s, 4 s ...): served once migrated
        wait_for(lambda: statuses(behind) == Counter(done=5), "the migrated target's jobs")
    finally:
        dispatcher.stop()
        runner.join(60)
    assert (behind.name, True) in states[states.index((behind.name, False)):]


def test_one_targets_backlog_does_not_starve_another(dsn: str, databases: Databases) -> None:
    # One slot (the budget of a look-out and one turn): the targets take turns of at most
    # TURN seconds, so the small target's jobs are not queued behind the big backlog.
    shared = databases.make("big", "small")
    big, small = Target(shared, "big"), Target(shared, "small")

    class Slow(Recorded):
        def perform(self, job: outbox.Job) -> None:
            time.sleep(0.005)  # the provider call's duration
            super().perform(job)

    enqueue(big, 6000)  # about 8 s of work at 4 at a time: many turns
    effect = Slow()
    dispatcher = Dispatcher(effects=[effect], targets=[big, small], max_connections=3,
                            concurrency=4, poll_interval=0.1)
    runner = threading.Thread(target=dispatcher.run)
    runner.start()
    try:
        wait_for(lambda: len(effect.performed) >= 100, "the big target's first jobs")
        enqueue(small, 5)
        wait_for(lambda: statuses(small) == Counter(done=5), "the small target's jobs")
        left = statuses(big)["pending"]
    finally:
        dispatcher.stop()
        runner.join(60)
    # the big target still had a backlog when the small one was served
    assert left > 0, "the small target waited for the whole backlog of the big one"


def test_a_target_whose_role_lacks_a_privilege_is_isolated(dsn: str,
                                                           databases: Databases) -> None:
    shared = databases.make("open", "closed")
    role = f"fleet_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(shared, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        # USAGE on the schema, nothing on its tables: the look and the turn are refused
        conn.execute(sql.SQL("GRANT USAGE ON SCHEMA closed TO {}").format(sql.Identifier(role)))
    try:
        closed = Target(make_conninfo(shared, user=role), "closed")
        open_ = Target(shared, "open")
        enqueue(open_, 10)
        enqueue(Target(shared, "closed"), 3)
        effect = Recorded()
        states: list[tuple[str, bool]] = []

        class Watch(outbox.observe.DispatchObserver):
            def target_state(self, target: str, up: bool) -> None:
                states.append((target, up))

        stats = Dispatcher(effects=[effect], targets=[closed, open_],
                           observer=Watch()).run_until_idle(timeout=60)
        assert stats.done == 10 and statuses(Target(shared, "closed")) == Counter(pending=3)
        assert (closed.name, False) in states and (open_.name, True) in states
    finally:
        with psycopg.connect(shared, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_an_enqueue_wakes_its_target_at_once(dsn: str, databases: Databases) -> None:
    # A poll interval far longer than the wait below: only the look-out's LISTEN can
    # bring the job to a turn in time.
    shared = databases.make("quiet")
    target = Target(shared, "quiet")
    effect = Recorded()
    served = threading.Event()

    class Watch(outbox.observe.DispatchObserver):
        def target_state(self, name: str, up: bool) -> None:
            if up:
                served.set()  # its first turn, with nothing to do, has ended

    dispatcher = Dispatcher(effects=[effect], targets=[target], poll_interval=60.0,
                            observer=Watch())
    runner = threading.Thread(target=dispatcher.run)
    runner.start()
    try:
        def listening() -> bool:
            with psycopg.connect(dsn, autocommit=True) as conn:
                row = conn.execute("SELECT count(*) FROM pg_stat_activity "
                                   "WHERE application_name LIKE 'outbox scout %%' "
                                   "AND query LIKE 'LISTEN%%'").fetchone()
            return bool(row and row[0])

        wait_for(listening, "the look-out's LISTEN")
        assert served.wait(60)
        enqueue(target, 1)
        wait_for(lambda: len(effect.performed) == 1, "the woken turn", timeout=20)
    finally:
        dispatcher.stop()
        runner.join(60)


def test_every_engine_of_a_fleet_claims_under_the_dispatchers_worker_id(
        dsn: str, databases: Databases) -> None:
    shared = databases.make("w1", "w2")
    targets = [Target(shared, "w1"), Target(shared, "w2")]
    for target in targets:
        enqueue(target, 5)
    holders: set[str] = set()

    class Holder(Recorded):
        """Reads, while it performs, who holds its job (claimed_by is cleared at done)."""

        def perform(self, job: outbox.Job) -> None:
            with psycopg.connect(shared, autocommit=True) as conn:
                for schema in ("w1", "w2"):
                    row = conn.execute(sql.SQL("SELECT claimed_by FROM {}.jobs WHERE key = %s")
                                       .format(sql.Identifier(schema)), (job.key,)).fetchone()
                    if row is not None:
                        holders.add(row[0])

    Dispatcher(effects=[Holder()], targets=targets,
               worker_id="fleet-7").run_until_idle(timeout=60)
    assert holders == {"fleet-7"}


def test_a_fleet_serves_its_targets_again_at_each_run(dsn: str, databases: Databases) -> None:
    target = Target(databases.make("outbox"))
    enqueue(target, 5)
    dispatcher = Dispatcher(effects=[Recorded()], targets=[target])
    assert dispatcher.run_until_idle(timeout=60).done == 5
    enqueue(target, 5, first=5)  # found idle by the first run: looked at again
    assert dispatcher.run_until_idle(timeout=60).done == 5
    assert statuses(target) == Counter(done=10)
