"""A busy dispatcher spares enqueues their NOTIFY, and a sleeping one is still woken at
once (migration 0019, ``outbox/_dispatch/awake.py``).

Whether an enqueue notified is read in commit order: after its commit, another
connection sends a NOTIFY of its own with a marker payload; the listener's first
notification is the enqueue's when it notified, the marker when it did not.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

import outbox
import outbox.sql
from outbox import Dispatcher, Effect, Job, NewJob

from .helpers import fetch, table, wait_for_listener, wait_until

EFFECT = "test.awake"
MARKER = "marker"


@pytest.fixture
def listener(dsn: str, schema: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("LISTEN {}").format(
            sql.Identifier(outbox.sql.notify_channel(schema))))
        yield conn


def notified(dsn: str, schema: str, listener: psycopg.Connection[Any]) -> bool:
    """Whether a notification came before the marker sent now (so: from a commit before)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_notify(%s, %s)", (outbox.sql.notify_channel(schema), MARKER))
    return bool(before_marker(listener))


def before_marker(listener: psycopg.Connection[Any]) -> list[str]:
    """The payloads of the notifications received before the marker."""
    payloads: list[str] = []
    while True:
        received = list(listener.notifies(timeout=20, stop_after=1))
        assert received, "the marker never came"
        for notify in received:
            if notify.payload == MARKER:
                return payloads
            payloads.append(notify.payload)


def enqueue(conn: psycopg.Connection[Any], schema: str, key: str, effect: str = EFFECT) -> None:
    with outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue(effect, key=key, payload={})


def mark_awake(dsn: str, schema: str, effect: str = EFFECT, worker: str = "w1") -> None:
    fetch(dsn, sql.SQL("INSERT INTO {} (effect, dispatcher, until) "
                       "VALUES (%s, %s, now() + interval '1 minute') RETURNING 1")
          .format(table(schema, "awake")), (effect, worker))


def marks(dsn: str, schema: str) -> list[tuple[Any, ...]]:
    return fetch(dsn, sql.SQL("SELECT effect, dispatcher FROM {} WHERE until > now()")
                 .format(table(schema, "awake")))


def fall_asleep(dsn: str, schema: str, timeout: str, worker: str = "w1") -> bool:
    rows = fetch(dsn, sql.SQL("SELECT {}.fall_asleep(%s, %s)").format(sql.Identifier(schema)),
                 (worker, timeout))
    return bool(rows[0][0])


def waiting_on_lock(dsn: str, schema: str, query_start: str) -> bool:
    """Whether a statement of ``schema``'s starting ``query_start`` waits for a lock (of
    this test's schema only: another test's may wait on a lock of its own meanwhile)."""
    return bool(fetch(dsn, "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                           "AND query LIKE %s AND position(%s in query) > 0",
                      (query_start + "%", f'"{schema}"')))


def test_an_enqueue_notifies_unless_a_dispatcher_of_its_effect_is_awake(
        dsn: str, schema: str, listener: psycopg.Connection[Any]) -> None:
    with psycopg.connect(dsn) as conn:
        enqueue(conn, schema, "a1")
        assert notified(dsn, schema, listener)
        mark_awake(dsn, schema)
        for i in range(8):  # past psycopg's prepare threshold: the prepared plan too
            enqueue(conn, schema, f"b{i}")
            assert not notified(dsn, schema, listener), i
        enqueue(conn, schema, "c1", effect="test.other")  # nobody awake for this one
        assert notified(dsn, schema, listener)
        with outbox.transaction(conn, schema=schema) as tx:
            tx.enqueue_many([NewJob(EFFECT, "m1", {}), NewJob(EFFECT, "m2", {})])
        assert not notified(dsn, schema, listener)
        with outbox.transaction(conn, schema=schema) as tx:
            tx.enqueue_many([NewJob(EFFECT, "m3", {}), NewJob("test.other", "m4", {})])
        assert notified(dsn, schema, listener)
        # An expired mark counts for nothing.
        fetch(dsn, sql.SQL("UPDATE {} SET until = now() - interval '1 second' RETURNING 1")
              .format(table(schema, "awake")))
        enqueue(conn, schema, "d1")
        assert notified(dsn, schema, listener)


def test_outside_read_committed_an_enqueue_always_notifies(
        dsn: str, schema: str, listener: psycopg.Connection[Any]) -> None:
    mark_awake(dsn, schema)
    with psycopg.connect(dsn) as conn:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        enqueue(conn, schema, "rr")
        assert notified(dsn, schema, listener)
        with outbox.transaction(conn, schema=schema) as tx:
            tx.enqueue_many([NewJob(EFFECT, "rr-many", {})])
        assert notified(dsn, schema, listener)


def test_falling_asleep_waits_for_the_enqueues_that_saw_the_mark(
        dsn: str, schema: str, listener: psycopg.Connection[Any]) -> None:
    """The fence: an open transaction that enqueued without notifying has committed
    before fall_asleep returns (so the claim after it sees the job); an enqueue that
    comes meanwhile waits, then sees no mark and notifies."""
    mark_awake(dsn, schema)
    asleep: list[bool] = []
    with psycopg.connect(dsn) as business, psycopg.connect(dsn) as later:
        with business.transaction():
            enqueue(business, schema, "open")  # saw the mark: no notify
            sleeper = threading.Thread(
                target=lambda: asleep.append(fall_asleep(dsn, schema, "60s")))
            sleeper.start()
            wait_until(lambda: waiting_on_lock(dsn, schema, "SELECT"), what="fall_asleep waiting")
            late = threading.Thread(target=enqueue, args=(later, schema, "late"))
            late.start()
            wait_until(lambda: waiting_on_lock(dsn, schema, "INSERT INTO"), what="late enqueue")
            assert not asleep and sleeper.is_alive()
        # The business transaction committed: the fence holds, the job is visible.
        sleeper.join(30)
        late.join(30)
    assert asleep == [True]
    assert marks(dsn, schema) == []
    assert {k for (k,) in fetch(dsn, sql.SQL("SELECT key FROM {}").format(
        table(schema, "jobs")))} == {"open", "late"}
    # "late" notified once; "open" did not (it saw the mark)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_notify(%s, %s)", (outbox.sql.notify_channel(schema), MARKER))
    assert before_marker(listener) == [""]


def test_falling_asleep_gives_up_waiting_after_its_timeout(dsn: str, schema: str) -> None:
    mark_awake(dsn, schema)
    with psycopg.connect(dsn) as business, business.transaction():
        enqueue(business, schema, "open")
        assert fall_asleep(dsn, schema, "50ms") is False
        assert marks(dsn, schema) == []  # the mark is gone all the same


def test_falling_asleep_holds_no_lock_on_the_marks_while_it_waits(dsn: str, schema: str) -> None:
    """While the fence waits, fall_asleep holds nothing on the awake table: a second
    dispatcher falling asleep at the same time never waits for it while it waits for
    the second (a deadlock)."""
    mark_awake(dsn, schema, worker="w1")
    mark_awake(dsn, schema, worker="w2")
    asleep: list[bool] = []
    with psycopg.connect(dsn) as business:
        with business.transaction():
            enqueue(business, schema, "open")
            sleeper = threading.Thread(
                target=lambda: asleep.append(fall_asleep(dsn, schema, "60s", worker="w1")))
            sleeper.start()
            wait_until(lambda: waiting_on_lock(dsn, schema, "SELECT"), what="fall_asleep waiting")
            held = fetch(dsn, "SELECT l.mode FROM pg_locks l JOIN pg_stat_activity a "
                              "ON a.pid = l.pid WHERE l.relation = %s::regclass "
                              "AND l.granted AND a.query LIKE 'SELECT%%fall_asleep%%'",
                         (f"{schema}.awake",))
            assert held == []
        sleeper.join(30)
    assert asleep == [True]
    assert marks(dsn, schema) == [(EFFECT, "w2")]


class Gate(Effect):
    """Blocks each perform until ``release`` is set."""

    name = EFFECT

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started: list[str] = []
        self.done: list[str] = []

    def perform(self, job: Job) -> None:
        self.started.append(job.key)
        assert self.release.wait(60)
        self.done.append(job.key)


def test_a_busy_dispatcher_is_not_notified_and_a_sleeping_one_is_woken(
        dsn: str, schema: str, listener: psycopg.Connection[Any]) -> None:
    gate = Gate()
    # Polling an hour away: only a notification, or the claimer's own next round, can
    # bring a job in time.
    dispatcher = Dispatcher(dsn, [gate], schema=schema, poll_interval=3600, concurrency=1,
                            prefetch=0)
    result: list[outbox.DispatchStats] = []
    thread = threading.Thread(target=lambda: result.append(dispatcher.run()))
    thread.start()
    try:
        wait_for_listener(dsn)
        with psycopg.connect(dsn) as conn:
            enqueue(conn, schema, "first")
            assert notified(dsn, schema, listener)  # asleep: woken by the notification
            wait_until(lambda: gate.started == ["first"], what="first performed")
            # Full (concurrency 1): busy, marked awake for its effect.
            wait_until(lambda: bool(marks(dsn, schema)), what="marked awake")
            assert {effect for effect, _ in marks(dsn, schema)} == {EFFECT}
            enqueue(conn, schema, "second")
            assert not notified(dsn, schema, listener)
            gate.release.set()  # room: it claims again without being told
            wait_until(lambda: gate.done == ["first", "second"], what="second performed")
            # Nothing left: its mark goes before it sleeps, and enqueues notify again.
            wait_until(lambda: marks(dsn, schema) == [], what="asleep")
            enqueue(conn, schema, "third")
            assert notified(dsn, schema, listener)
            wait_until(lambda: gate.done == ["first", "second", "third"], what="woken")
    finally:
        gate.release.set()
        dispatcher.stop()
        thread.join(timeout=30)
    assert not thread.is_alive()
    assert result[0].done == 3


def test_a_stopping_dispatcher_takes_its_mark_away(dsn: str, schema: str) -> None:
    gate = Gate()
    with psycopg.connect(dsn) as conn:
        enqueue(conn, schema, "held")
    dispatcher = Dispatcher(dsn, [gate], schema=schema, poll_interval=3600, concurrency=1,
                            prefetch=0, stop_timeout=30)
    thread = threading.Thread(target=dispatcher.run)
    thread.start()
    try:
        wait_until(lambda: gate.started == ["held"], what="held performed")
        wait_until(lambda: bool(marks(dsn, schema)), what="marked awake")
    finally:
        dispatcher.stop()
        gate.release.set()
        thread.join(timeout=30)
    assert not thread.is_alive()
    assert marks(dsn, schema) == []
