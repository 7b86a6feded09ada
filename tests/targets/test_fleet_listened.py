"""A listening look-out asks a schema only when something may have changed there: once
every target schema of its database has had its first turn (and been asked after it),
rounds go by in which no schema is asked, yet a job enqueued into one of them is done
(its notification), a job enqueued to run three seconds later is done when due, a retry
after its backoff is done (the look after the turn that failed it said when), and a job
whose enqueue sent no NOTIFY, silenced by a dispatcher marked awake, is done once that
mark ends: with ``quiet_look_interval`` at an hour, nothing else could have found them.
A lost connection makes the look-out LISTEN again and ask every schema; a schema added
while running is listened to and asked after its first turn. ``Dispatcher``
and ``AsyncDispatcher`` alike (the look-out is one thread for both).
(Counted and awaited, never timed; the rule alone: tests/unit/test_looks.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from datetime import timedelta
from functools import partial
from typing import Any

import psycopg
import pytest
from psycopg import sql

import outbox
from outbox import AsyncDispatcher, Dispatcher, Effect, Job, Retry, Target
from outbox._dispatch.looks import Due, ask
from outbox._enqueue import notify_channel
from outbox._steps import execute, run

from .support import Databases
from .test_fleet import wait_for
from .test_fleet_quiet import FirstTurns

SCHEMAS = 8
QUIET_ROUNDS = 5  # rounds in a row with no schema asked
MARKER = "test_listened_marker"  # a channel no dispatcher listens to
AWAKE_SECONDS = 8.0  # the mark must outlast the turn and look it waits for, under load


class Done(Effect):
    """Sets an event per key performed; a key starting ``retry`` asks for a retry two
    seconds later at its first attempt."""

    name = "test.listened"

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: dict[str, threading.Event] = {}
        self.attempts: dict[str, int] = {}

    def event(self, key: str) -> threading.Event:
        with self.lock:
            return self.events.setdefault(key, threading.Event())

    def perform(self, job: Job) -> None:
        with self.lock:
            self.attempts[job.key] = self.attempts.get(job.key, 0) + 1
        if job.key.startswith("retry") and job.attempt == 1:
            raise Retry("not yet", after=2.0)
        self.event(job.key).set()


@pytest.fixture(scope="module")
def schemas_db(dsn: str) -> Iterator[str]:
    """One database of SCHEMAS migrated target schemas, for the module's tests (each
    test's jobs under keys of its own)."""
    made = Databases(dsn)
    try:
        yield made.make(*(f"t{n}" for n in range(SCHEMAS)))
    finally:
        made.drop()


def listening_fleet(db: str, kind: type[Dispatcher] | type[AsyncDispatcher],
                    ) -> tuple[Any, list[Target], Done, FirstTurns]:
    targets = [Target(db, f"t{n}") for n in range(SCHEMAS)]
    effect, watch = Done(), FirstTurns(SCHEMAS)
    dispatcher = kind(effects=[effect], targets=targets, max_connections=8,
                      poll_interval=0.1, quiet_look_interval=timedelta(hours=1),
                      observer=watch)
    return dispatcher, targets, effect, watch


def scout_of(fleet: Any) -> Any:
    """The fleet's one look-out: a listening one."""
    scouts = list(fleet.scouts.values())
    assert len(scouts) == 1 and scouts[0].persistent, scouts
    return scouts[0]


def wait_quiet(fleet: Any) -> None:
    """Until QUIET_ROUNDS rounds in a row skipped every schema and asked none."""
    mark: list[tuple[int, int]] = []

    def quiet() -> bool:
        now = (int(fleet.asks), int(fleet.asks_skipped))
        if not mark or now[0] != mark[0][0]:
            mark[:] = [now]
        return now[1] - mark[0][1] >= QUIET_ROUNDS * SCHEMAS

    wait_for(quiet, f"{QUIET_ROUNDS} rounds with no schema asked")


def remembered(scout: Any, target: Target, what: str) -> None:
    """Until the look-out remembers when to ask ``target`` again."""
    wait_for(lambda: (asked := scout.asked.get(target)) is not None
             and asked.next_due is not None, what)


def enqueue(target: Target, key: str, run_at: timedelta | None = None) -> None:
    with psycopg.connect(target.dsn) as conn, \
            outbox.transaction(conn, schema=target.schema) as tx:
        tx.enqueue(Done.name, key=key, payload={}, run_at=run_at)


def notified(target: Target, key: str) -> bool:
    """Enqueue ``key`` into ``target`` and say whether its commit sent a NOTIFY: a
    listener of the target's channel reads what came before a marker notified on
    another channel afterwards (notifications arrive in commit order)."""
    channel = notify_channel(target.schema)
    with psycopg.connect(target.dsn, autocommit=True) as listener:
        listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(MARKER)))
        enqueue(target, key)
        with psycopg.connect(target.dsn, autocommit=True) as other:
            other.execute("SELECT pg_notify(%s, '')", (MARKER,))
        seen: list[str] = []
        for note in listener.notifies(timeout=60):
            if note.channel == MARKER:
                break
            seen.append(note.channel)
    return channel in seen


def mark_awake(target: Target, seconds: float) -> None:
    """Another dispatcher serving the effect, marked awake for ``seconds`` (as its
    claimer marks itself: presence.sql, awake_mark)."""
    with psycopg.connect(target.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL(
            "INSERT INTO {}.awake (effect, dispatcher, until) "
            "VALUES (%s, 'another', now() + %s * interval '1 second') "
            "ON CONFLICT (effect, dispatcher) DO UPDATE SET until = EXCLUDED.until").format(
            sql.Identifier(target.schema)), (Done.name, seconds))


def wake(target: Target) -> None:
    """A notification on the target's channel, as an enqueue sends: a turn of it."""
    with psycopg.connect(target.dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_notify(%s, '')", (notify_channel(target.schema),))


@contextlib.contextmanager
def running(dispatcher: Any, watch: FirstTurns) -> Iterator[Any]:
    """The fleet's run on a thread, once every target has had its first turn: its one
    look-out, once no schema is asked any more; stopped after."""
    def serving() -> object:
        if isinstance(dispatcher, AsyncDispatcher):
            return asyncio.run(dispatcher.run())
        return dispatcher.run()

    runner = threading.Thread(target=serving, name="test-runner")
    runner.start()
    try:
        assert watch.all_up.wait(120), f"only {len(watch.up)} targets served"
        scout = scout_of(dispatcher._fleet)
        wait_quiet(dispatcher._fleet)
        yield scout
    finally:
        dispatcher.stop()
        runner.join(60)
    assert not runner.is_alive()


def serve(dispatcher: Any, targets: list[Target], effect: Done, watch: FirstTurns,
          tag: str) -> None:
    """Run the fleet; once no schema is asked any more, the jobs of the module's
    docstring, each done."""
    fleet = dispatcher._fleet
    with running(dispatcher, watch) as scout:
        enqueue(targets[0], f"{tag}-now")
        assert effect.event(f"{tag}-now").wait(60), "the job enqueued into a quiet schema"
        wait_quiet(fleet)

        # The three waits overlap: an enqueue silenced by an awake mark, a job to run
        # three seconds later, and a retry two seconds after its first attempt. The
        # notifications woke the targets; the looks after those turns found nothing due
        # yet and remembered when to ask again.
        later, retried, silenced = targets[1:4]
        mark_awake(silenced, AWAKE_SECONDS)
        wake(silenced)  # a turn of it, and the look after it, which sees the mark
        remembered(scout, silenced, "the look that saw the awake mark")
        assert not notified(silenced, f"{tag}-silenced"), "the awake mark silences it"
        enqueue(later, f"{tag}-later", run_at=timedelta(seconds=3))
        enqueue(retried, f"retry-{tag}")
        remembered(scout, later, "the look that found the delayed job")
        assert effect.event(f"{tag}-later").wait(60), "the delayed job"
        assert effect.event(f"retry-{tag}").wait(60), "the job retried after its backoff"
        assert effect.attempts[f"retry-{tag}"] == 2
        assert effect.event(f"{tag}-silenced").wait(60), "the job enqueued silently"


@pytest.mark.parametrize("kind", [Dispatcher, AsyncDispatcher])
def test_quiet_schemas_are_not_asked_and_their_work_is_still_done(
        schemas_db: str, kind: type[Dispatcher] | type[AsyncDispatcher]) -> None:
    dispatcher, targets, effect, watch = listening_fleet(schemas_db, kind)
    serve(dispatcher, targets, effect, watch, kind.__name__)


def test_a_lost_connection_listens_again_and_asks_every_schema(schemas_db: str) -> None:
    dispatcher, targets, effect, watch = listening_fleet(schemas_db, Dispatcher)
    fleet = dispatcher._fleet
    with running(dispatcher, watch) as scout:
        lost = scout.conn
        asks = fleet.asks
        with psycopg.connect(schemas_db, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                          "WHERE datname = current_database() "
                          "AND application_name LIKE 'outbox scout%%'")
        wait_for(lambda: fleet.asks >= asks + SCHEMAS, "every schema asked again")
        assert scout.conn is not lost
        wait_quiet(fleet)
        enqueue(targets[5], "after-reconnect")
        assert effect.event("after-reconnect").wait(60), "a job after the new LISTEN"


def test_a_target_added_is_listened_to_and_asked(schemas_db: str) -> None:
    # A schema added while running: its first turn does what was enqueued before
    # anyone listened to it, the look after that turn is remembered, and from then on
    # its notification wakes it (with quiet_look_interval at an hour, nothing else would).
    with psycopg.connect(schemas_db, autocommit=True) as conn:
        outbox.migrate(conn, schema="added")
    added = Target(schemas_db, "added")
    current = [Target(schemas_db, f"t{n}") for n in range(SCHEMAS)]
    effect, watch = Done(), FirstTurns(SCHEMAS)
    dispatcher = Dispatcher(effects=[effect], targets=lambda: list(current),
                            targets_interval=0.2, max_connections=8, poll_interval=0.1,
                            quiet_look_interval=timedelta(hours=1), observer=watch)
    fleet = dispatcher._fleet
    with running(dispatcher, watch) as scout:
        enqueue(added, "before-added")
        current.append(added)
        assert effect.event("before-added").wait(60), "the job enqueued before it was added"
        wait_for(lambda: added in scout.asked, "the look after its first turn")
        wait_quiet(fleet)
        enqueue(added, "added-later", run_at=timedelta(seconds=2))
        assert effect.event("added-later").wait(60), "a delayed job of the added schema"


def test_the_question_says_when_to_ask_again(dsn: str, schema: str) -> None:
    # Nothing pending: nothing to wait for. An awake mark: its end. A schema whose
    # awake marks cannot be read: asked as before, and again every round (next_in 0).
    # A missing schema: the error is its answer.
    target = Target(dsn, schema)
    effects = "{" + Done.name + "}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        def answer(name: str = schema) -> Any:
            return run(ask([name], effects), partial(execute, conn)).answers[name]

        assert answer() == Due(False, None)
        mark_awake(target, 30.0)
        marked = answer()
        assert not marked.due and 10.0 < marked.next_in <= 30.0, marked
        enqueue(target, "soon", run_at=timedelta(seconds=10))
        soon = answer()
        assert not soon.due and 0.0 < soon.next_in <= 10.0, soon
        conn.execute(sql.SQL("DROP TABLE {}.awake CASCADE").format(sql.Identifier(schema)))
        assert answer() == Due(False, 0.0)
        conn.execute(sql.SQL("UPDATE {}.jobs SET available_at = now()").format(
            sql.Identifier(schema)))
        assert answer() == Due(True, 0.0)
        assert isinstance(answer("no_such_schema"), psycopg.errors.UndefinedTable)
