"""The polling look-out's skip rule (``outbox._dispatch.looks``), without a database: a
database is skipped only while its counters stand where they stood before its last
look, that look said no job falls due before now, and it was less than the quiet
interval ago; anything it cannot compare is looked at. The listening look-out's rule
(``must_ask``): a schema is skipped only while no turn of it ended since its last look
began, the time that look gave has not come, and it was less than the quiet interval
ago; a schema never asked, or whose look found work or could not read it, is asked."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from outbox import AsyncDispatcher, ConfigurationError, Dispatcher, Effect, Job, Target
from outbox._dispatch.looks import (
    Asked,
    Counters,
    Due,
    Identity,
    Looked,
    Seen,
    asked_after,
    must_ask,
    must_look,
    seen_after,
    server_key,
)

EVERY = 30.0
HERE = Identity(server=1_700_000_000.25, datid=16_384)
READ_AT = 1_765_000_000.5  # the server's clock when BEFORE was read
BEFORE = Counters(server=HERE.server, datid=HERE.datid, xact_commit=100, tup_inserted=10,
                  tup_updated=5, tup_deleted=1, stats_reset=None, read_at=READ_AT,
                  changed_at=READ_AT - 60)


def rows(*counters: Counters) -> dict[Identity, Counters]:
    return {c.identity: c for c in counters}


def seen(at: float = 100.0, next_due: float | None = None) -> Seen:
    return Seen(BEFORE, at, next_due)


def test_unchanged_counters_and_nothing_due_before_now_skip() -> None:
    assert not must_look(seen(), rows(BEFORE), 101.0, every=EVERY)
    assert not must_look(seen(at=180.0, next_due=200.0), rows(BEFORE), 199.9, every=EVERY)


def test_a_transaction_that_wrote_nothing_does_not_count_as_a_move() -> None:
    # every look commits a read-only transaction in the database it looks at
    later = dataclasses.replace(BEFORE, xact_commit=BEFORE.xact_commit + 7)
    assert not must_look(seen(), rows(later), 101.0, every=EVERY)


@pytest.mark.parametrize("moved", [
    {"tup_inserted": 11}, {"tup_updated": 6}, {"tup_deleted": 2},
    {"stats_reset": 1_700_000_100.0},  # counters reset: they can no longer be compared
])
def test_a_counter_that_moved_is_looked_at(moved: dict[str, Any]) -> None:
    assert must_look(seen(), rows(dataclasses.replace(BEFORE, **moved)), 101.0, every=EVERY)


def test_a_backend_that_changed_state_since_the_read_is_looked_at() -> None:
    # a commit not yet in the counters (its backend holds them up to 10 s): its state
    # change is seen at once
    later = dataclasses.replace(BEFORE, read_at=READ_AT + 1, changed_at=READ_AT + 0.2)
    assert must_look(seen(), rows(later), 101.0, every=EVERY)
    # state changes up to the read, or none seen (no other backend, or hidden): counters
    for changed_at in (READ_AT, READ_AT - 5, None):
        still = dataclasses.replace(BEFORE, read_at=READ_AT + 1, changed_at=changed_at)
        assert not must_look(seen(), rows(still), 101.0, every=EVERY), changed_at


def test_the_quiet_interval_passed_is_looked_at() -> None:
    assert not must_look(seen(at=100.0), rows(BEFORE), 100.0 + EVERY - 0.01, every=EVERY)
    assert must_look(seen(at=100.0), rows(BEFORE), 100.0 + EVERY, every=EVERY)


def test_a_job_falling_due_is_looked_at_then() -> None:
    assert must_look(seen(next_due=150.0), rows(BEFORE), 150.0, every=EVERY)


@pytest.mark.parametrize("found", [
    None,  # the server's counters could not be read
    {},  # no row for it: dropped, or a row of another server
    rows(dataclasses.replace(BEFORE, server=HERE.server + 1)),  # the server restarted
    rows(dataclasses.replace(BEFORE, datid=HERE.datid + 1)),  # made again: a new oid
])
def test_a_missing_row_is_looked_at(found: dict[Identity, Counters] | None) -> None:
    assert must_look(seen(), found, 101.0, every=EVERY)


def test_a_database_never_looked_at_is_looked_at() -> None:
    assert must_look(None, rows(BEFORE), 101.0, every=EVERY)


def looked(*answers: Due | psycopg.Error, identity: Identity | None = HERE) -> Looked:
    return Looked(identity, {f"s{n}": a for n, a in enumerate(answers)})


def test_a_look_remembers_the_counters_read_before_it_and_its_next_due_job() -> None:
    after = seen_after(looked(Due(False, 12.5), Due(False, None), Due(False, 4.0)),
                       rows(BEFORE), 100.0, pooled=False)
    assert after == Seen(BEFORE, 100.0, 104.0)
    nothing = seen_after(looked(Due(False, None)), rows(BEFORE), 100.0, pooled=False)
    assert nothing == Seen(BEFORE, 100.0, None)
    # a due time already past (the clock moved while asking): due at once
    past = seen_after(looked(Due(False, -0.2)), rows(BEFORE), 100.0, pooled=False)
    assert past == Seen(BEFORE, 100.0, 100.0)


def test_a_look_that_found_work_comes_back_next_round() -> None:
    after = seen_after(looked(Due(True, None), Due(False, 60.0)), rows(BEFORE), 100.0,
                       pooled=False)
    assert after is not None and after.next_due == 100.0
    assert must_look(after, rows(BEFORE), 100.1, every=EVERY)


@pytest.mark.parametrize(("answers", "identity", "found", "pooled"), [
    ((Due(False, None),), HERE, rows(BEFORE), True),  # through a pooler
    ((Due(False, None),), None, rows(BEFORE), False),  # not identified
    ((Due(False, None),), HERE, {}, False),  # its row not read before the look
    ((Due(False, None),), HERE, None, False),  # the counters not read at all
    ((Due(False, None), psycopg.errors.UndefinedTable("no jobs")), HERE, rows(BEFORE),
     False),  # a target unreadable
])
def test_a_look_that_cannot_be_compared_later_is_not_remembered(
        answers: tuple[Due | psycopg.Error, ...], identity: Identity | None,
        found: dict[Identity, Counters] | None, pooled: bool) -> None:
    assert seen_after(looked(*answers, identity=identity), found, 100.0, pooled=pooled) is None


@pytest.mark.parametrize(("dsn", "key"), [
    ("host=db1 port=5433 dbname=a", "db1||5433"),
    ("postgresql://app@db1:5433/b", "db1||5433"),
    ("dbname=c", "||"),  # libpq's default: the same for every such string in a process
    ("host=/tmp dbname=d", "/tmp||"),
    ("host=db1,db2 dbname=e", None),  # several hosts: which one answers is not known
    ("service=tenants", None),
])
def test_the_server_of_a_connection_string(dsn: str, key: str | None) -> None:
    assert server_key(dsn) == key


def test_a_schema_asked_lately_with_nothing_since_is_not_asked() -> None:
    asked = Asked(at=100.0, next_due=None)
    assert not must_ask(asked, 100.0 + EVERY - 0.01, last_turn=99.0, every=EVERY)
    assert not must_ask(asked, 101.0, last_turn=0.0, every=EVERY)  # never had a turn
    assert not must_ask(Asked(130.0, 150.0), 149.9, last_turn=99.0, every=EVERY)


def test_a_schema_never_asked_is_asked() -> None:
    # a new target, or every schema after a new connection's LISTENs
    assert must_ask(None, 101.0, last_turn=0.0, every=EVERY)


def test_a_turn_that_ended_after_the_look_began_brings_it_back() -> None:
    # a retry's backoff, a lease it took, a job enqueued while it ran: asked after it
    asked = Asked(at=100.0, next_due=None)
    assert must_ask(asked, 101.0, last_turn=100.0, every=EVERY)
    assert must_ask(asked, 101.0, last_turn=100.5, every=EVERY)


def test_the_time_the_look_gave_brings_it_back() -> None:
    # a run_at, a backoff, a lease's end, an awake mark's end
    assert must_ask(Asked(100.0, 150.0), 150.0, last_turn=99.0, every=EVERY)


def test_the_quiet_interval_passed_brings_it_back() -> None:
    assert must_ask(Asked(100.0, None), 100.0 + EVERY, last_turn=99.0, every=EVERY)
    assert must_ask(Asked(100.0, 500.0), 100.0 + EVERY, last_turn=99.0, every=EVERY)


def test_a_look_remembers_when_to_ask_again() -> None:
    assert asked_after(Due(False, 12.5), 100.0) == Asked(100.0, 112.5)
    assert asked_after(Due(False, None), 100.0) == Asked(100.0, None)
    # a time already past (the clock moved while asking): asked at the next round
    assert asked_after(Due(False, -0.2), 100.0) == Asked(100.0, 100.0)
    # its awake marks unreadable: asked as before, every round
    zero = asked_after(Due(False, 0.0), 100.0)
    assert zero is not None and must_ask(zero, 100.1, last_turn=0.0, every=EVERY)


@pytest.mark.parametrize("answer", [
    Due(True, None),  # due: its turn comes, and it is asked after that turn
    psycopg.errors.UndefinedTable("no jobs"),  # unreadable: marked down, asked again
    None,  # not answered
])
def test_a_look_that_found_work_or_none_is_not_remembered(
        answer: Due | psycopg.Error | None) -> None:
    assert asked_after(answer, 100.0) is None


class _Noop(Effect):
    name = "test.noop"

    def perform(self, job: Job) -> None:
        return None


@pytest.mark.parametrize("bad", [0, -1.0, True, "30", None])
def test_a_quiet_look_interval_that_is_no_positive_duration_is_refused(bad: Any) -> None:
    with pytest.raises(ConfigurationError, match="quiet_look_interval must be a positive"):
        Dispatcher(effects=[_Noop()], targets=[Target("dbname=tenant")],
                   quiet_look_interval=bad)


def test_a_quiet_look_interval_is_seconds_or_a_timedelta() -> None:
    for given in (timedelta(minutes=2), 120):
        fleet = AsyncDispatcher(effects=[_Noop()], targets=[Target("dbname=tenant")],
                                quiet_look_interval=given)._fleet
        assert fleet is not None and fleet.quiet_look_interval == 120.0
