"""Schedules run by in-process dispatchers on a real PostgreSQL: slots enqueued once,
``job.scheduled_for``, a fake clock across a DST change, stored schedules picked up by a
running dispatcher, code winning over the store."""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from psycopg import sql
from psycopg.conninfo import make_conninfo

import outbox
from outbox.cli import main

from .support import EFFECT, Recording


def utc(year: int, month: int, day: int, hour: int = 0, minute: int = 0,
        second: int = 0) -> datetime:
    return datetime(year, month, day, hour, minute, second, tzinfo=UTC)


class Clock:
    """A fake clock the scheduler goes by."""

    def __init__(self, at: datetime) -> None:
        self.at = at

    def __call__(self) -> datetime:
        return self.at


def dispatcher(dsn: str, schema: str, effect: Recording, schedules: list[outbox.Schedule],
               clock: Clock | None = None) -> outbox.Dispatcher:
    d = outbox.Dispatcher(dsn, effects=[effect], schema=schema, lease=5.0,
                          schedules=schedules)
    d._schedule_clock = clock
    return d


def cli(dsn: str, schema: str, *args: str, code: int = 0) -> Any:
    """``outbox schedules ARGS`` on the test's schema; its exit code checked."""
    result = CliRunner().invoke(main, ["schedules", "--dsn", dsn, "--schema", schema, *args])
    assert result.exit_code == code, result.output
    return result


def rows(dsn: str, query: str, schema: str, params: dict[str, object] | None = None,
         ) -> list[tuple[object, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(sql.SQL(query).format(s=sql.Identifier(schema)),
                            params).fetchall()


def test_a_fake_clock_across_the_autumn_change_fires_each_slot_once(
        dsn: str, schema: str) -> None:
    """03:00 -> 02:00 in Berlin: the fixed-time nightly job runs once, the half-hourly one
    every half hour of real time, each slot's job once, even with two dispatchers."""
    clock = Clock(utc(2026, 10, 24, 22, 50))
    schedules = [
        outbox.Schedule("nightly", effect=EFFECT, cron="30 2 * * *", timezone="Europe/Berlin",
                        catch_up="all", payload={"run": "nightly"}),
        outbox.Schedule("half-hourly", effect=EFFECT, cron="*/30 * * * *",
                        timezone="Europe/Berlin", catch_up="all", group="t1", priority=2),
    ]
    first, second = Recording(), Recording()
    one = dispatcher(dsn, schema, first, schedules, clock)
    two = dispatcher(dsn, schema, second, schedules, clock)
    one.run_until_idle(timeout=30)  # declares: the first slots are after 22:50
    assert first.jobs == []
    clock.at = utc(2026, 10, 25, 2, 10)  # the night, caught up in one pass
    one.run_until_idle(timeout=30)
    two.run_until_idle(timeout=30)
    clock.at = utc(2026, 10, 25, 3, 0)
    two.run_until_idle(timeout=30)
    one.run_until_idle(timeout=30)
    jobs = first.jobs + second.jobs
    slots = {name: sorted(j.scheduled_for for j in jobs if j.key.startswith(f"schedule:{name}:")
                          if j.scheduled_for is not None)
             for name in ("nightly", "half-hourly")}
    # 02:30 CEST is 00:30 UTC; the second 02:30 (CET, 01:30 UTC) does not fire it again.
    assert slots["nightly"] == [utc(2026, 10, 25, 0, 30)]
    assert slots["half-hourly"] == [utc(2026, 10, 24, 23) + timedelta(minutes=30 * i)
                                    for i in range(9)]
    assert len(jobs) == len({j.key for j in jobs}) == 10
    nightly = next(j for j in jobs if j.key.startswith("schedule:nightly:"))
    assert nightly.key == "schedule:nightly:2026-10-25T00:30:00Z"
    assert nightly.payload == {"run": "nightly"}
    assert nightly.scheduled_for is not None and nightly.scheduled_for.utcoffset() is not None
    half = next(j for j in jobs if j.key.startswith("schedule:half-hourly:"))
    assert (half.group, half.priority, half.payload) == ("t1", 2, {})
    [(last_slot, last_job, next_slot)] = rows(
        dsn, "SELECT last_slot, last_job_id, next_slot FROM {s}.schedules WHERE name = "
        "'half-hourly'", schema)
    assert last_slot == utc(2026, 10, 25, 3)
    assert last_job == max(j.id for j in jobs if j.key.startswith("schedule:half-hourly:"))
    assert next_slot == utc(2026, 10, 25, 3, 30)


def test_a_fake_clock_across_the_spring_change_fires_the_skipped_slot_after_the_jump(
        dsn: str, schema: str) -> None:
    clock = Clock(utc(2026, 3, 28, 12))
    effect = Recording()
    d = dispatcher(dsn, schema, effect, [outbox.Schedule(
        "nightly", effect=EFFECT, cron="30 2 * * *", timezone="Europe/Berlin")], clock)
    d.run_until_idle(timeout=30)
    clock.at = utc(2026, 3, 29, 0, 59)  # 01:59 CET: not yet
    d.run_until_idle(timeout=30)
    assert effect.jobs == []
    clock.at = utc(2026, 3, 29, 1, 0)  # 03:00 CEST, the first minute after the jump
    d.run_until_idle(timeout=30)
    assert [j.scheduled_for for j in effect.jobs] == [utc(2026, 3, 29, 1)]


def test_a_running_dispatcher_fires_every_second_with_the_slot_and_the_payload(
        dsn: str, schema: str) -> None:
    effect = Recording()
    d = dispatcher(dsn, schema, effect, [outbox.Schedule(
        "tick", effect=EFFECT, every=1, payload={"sweep": "provider"})])
    runner = threading.Thread(target=d.run)
    runner.start()
    try:
        jobs = effect.wait_for(3)
    finally:
        d.stop()
        runner.join(60)
    slots = [j.scheduled_for for j in jobs]
    assert all(s is not None and s.microsecond == 0 and s.utcoffset() == timedelta(0)
               for s in slots)
    assert len(set(slots)) == len(slots)
    assert all(j.payload == {"sweep": "provider"} for j in jobs)
    assert [j.key for j in jobs[:1]] == [
        outbox.schedules.slot_key("tick", slots[0])]  # type: ignore[arg-type]


def test_the_async_dispatcher_runs_schedules_too(dsn: str, schema: str) -> None:
    effect = Recording()

    async def main() -> None:
        d = outbox.AsyncDispatcher(dsn, effects=[effect], schema=schema, lease=5.0,
                                   schedules=[outbox.Schedule("tick", effect=EFFECT, every=1)])
        async with d:
            await asyncio.to_thread(effect.wait_for, 2)

    asyncio.run(main())
    assert len({j.scheduled_for for j in effect.jobs}) == len(effect.jobs) >= 2


def test_a_slot_already_enqueued_is_not_enqueued_again(dsn: str, schema: str) -> None:
    """The key is the safety net: a slot whose job exists (another dispatcher, a state
    lost) is a no-op; the schedule still advances."""
    clock = Clock(utc(2026, 12, 5, 2, 59))
    effect = Recording()
    schedule = outbox.Schedule("nightly", effect=EFFECT, cron="0 3 * * *")
    d = dispatcher(dsn, schema, effect, [schedule], clock)
    d.run_until_idle(timeout=30)
    key = outbox.schedules.slot_key("nightly", utc(2026, 12, 5, 3))
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue(EFFECT, key=key, payload={})
    clock.at = utc(2026, 12, 5, 3, 0, 1)
    d.run_until_idle(timeout=30)
    assert [j.key for j in effect.jobs] == [key]
    assert effect.jobs[0].scheduled_for is None  # the job enqueued by hand, not stamped
    [(count, next_slot)] = rows(dsn, "SELECT (SELECT count(*) FROM {s}.jobs), next_slot "
                                "FROM {s}.schedules", schema)
    assert (count, next_slot) == (1, utc(2026, 12, 6, 3))


def test_a_running_dispatcher_picks_up_a_stored_schedule(dsn: str, schema: str) -> None:
    effect = Recording()
    d = dispatcher(dsn, schema, effect, [])
    runner = threading.Thread(target=d.run)
    runner.start()
    try:
        added = cli(dsn, schema, "add", "stored", "--effect", EFFECT, "--every", "1",
                    "--actor", "test")
        assert added.stdout == f"schedule stored added: every 1s, effect {EFFECT}\n"
        jobs = effect.wait_for(2)
    finally:
        d.stop()
        runner.join(60)
    assert all(j.key.startswith("schedule:stored:") for j in jobs)
    [(actor, action, affected)] = rows(
        dsn, "SELECT actor, action, affected FROM {s}.dashboard_audit", schema)
    assert (actor, action, affected) == ("test", "schedule_add", 1)


def test_code_wins_over_a_stored_schedule_of_the_same_name(
        dsn: str, schema: str, caplog: pytest.LogCaptureFixture) -> None:
    cli(dsn, schema, "add", "report", "--effect", EFFECT, "--every", "3600")
    effect = Recording()
    code = outbox.Schedule("report", effect=EFFECT, cron="0 7 * * *")
    with caplog.at_level(logging.WARNING, "outbox.schedules"):
        dispatcher(dsn, schema, effect, [code]).run_until_idle(timeout=30)
    assert "'report' is declared in the dispatcher's code and was also stored" in caplog.text
    [(source, definition)] = rows(dsn, "SELECT source, definition FROM {s}.schedules", schema)
    assert (source, definition["cron"]) == ("code", "0 7 * * *")  # type: ignore[index]
    refused = cli(dsn, schema, "add", "report", "--effect", EFFECT, "--every", "60", code=1)
    assert "schedule 'report' is declared in a dispatcher's code, which wins" in refused.output
    refused = cli(dsn, schema, "remove", "report", code=1)
    assert "declared in a dispatcher's code and would come back" in refused.output


def test_a_schedule_for_an_effect_the_dispatcher_does_not_run_is_warned(
        dsn: str, schema: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "outbox.schedules"):
        dispatcher(dsn, schema, Recording(), [
            outbox.Schedule("typo", effect="sched.recrod", every=60)])
    assert "schedule 'typo' enqueues effect 'sched.recrod', which this dispatcher does " \
           "not run" in caplog.text


def test_schedules_must_be_schedules_with_distinct_names(dsn: str, schema: str) -> None:
    s = outbox.Schedule("a", effect=EFFECT, every=1)
    with pytest.raises(outbox.ConfigurationError, match="two schedules are named 'a'"):
        dispatcher(dsn, schema, Recording(), [s, s])
    with pytest.raises(outbox.ConfigurationError, match="list of outbox.Schedule"):
        dispatcher(dsn, schema, Recording(), s)  # type: ignore[arg-type]


def test_a_slot_key_holding_another_request_is_an_error_of_that_schedule_only(
        dsn: str, schema: str, caplog: pytest.LogCaptureFixture) -> None:
    """The round's batch is refused whole by the conflict: rolled back to its savepoint
    and enqueued one job at a time, so the other schedules of the round still fire."""
    clock = Clock(utc(2026, 12, 5, 2, 59))
    effect = Recording()
    d = dispatcher(dsn, schema, effect, [
        outbox.Schedule("nightly", effect=EFFECT, cron="0 3 * * *"),
        outbox.Schedule("other", effect=EFFECT, cron="0 3 * * *")], clock)
    d.run_until_idle(timeout=30)
    key = outbox.schedules.slot_key("nightly", utc(2026, 12, 5, 3))
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue(EFFECT, key=key, payload={"by": "hand"})
    clock.at = utc(2026, 12, 5, 3, 0, 1)
    with caplog.at_level(logging.ERROR, "outbox.schedules"):
        d.run_until_idle(timeout=30)
    assert sorted(j.key for j in effect.jobs) == [
        key, outbox.schedules.slot_key("other", utc(2026, 12, 5, 3))]
    stamped = {j.key: j.scheduled_for for j in effect.jobs}
    assert stamped[key] is None and stamped[f"schedule:other:{key.split(':', 2)[2]}"] == utc(
        2026, 12, 5, 3)
    errors = {name: error for name, error in rows(
        dsn, "SELECT name, last_error FROM {s}.schedules", schema)}
    assert errors["other"] is None
    assert "already used for" in str(errors["nightly"]) or "different payload" in str(
        errors["nightly"])
    assert "schedule 'nightly': slot 2026-12-05T03:00:00+00:00" in caplog.text


def test_a_role_that_may_not_use_the_schedules_table_still_dispatches_and_says_why(
        dsn: str, schema: str, caplog: pytest.LogCaptureFixture) -> None:
    role = f"no_schedules_{uuid.uuid4().hex[:8]}"
    ident = {"s": sql.Identifier(schema), "r": sql.Identifier(role)}
    with psycopg.connect(dsn, autocommit=True) as conn:
        for statement in ("CREATE ROLE {r} LOGIN", "GRANT USAGE ON SCHEMA {s} TO {r}",
                          "GRANT ALL ON ALL TABLES IN SCHEMA {s} TO {r}",
                          "REVOKE ALL ON {s}.schedules FROM {r}"):
            conn.execute(sql.SQL(statement).format(**ident))
        with outbox.transaction(conn, schema=schema) as tx:
            tx.enqueue(EFFECT, key="k1", payload={})
    try:
        effect = Recording()
        with caplog.at_level(logging.WARNING, "outbox.schedules"):
            stats = outbox.Dispatcher(make_conninfo(dsn, user=role), effects=[effect],
                                      schema=schema).run_until_idle(timeout=30)
        assert stats.done == 1 and [j.key for j in effect.jobs] == ["k1"]
        assert caplog.text.count("may not use the schedules table") == 1
        assert "grant it SELECT, INSERT, UPDATE on <schema>.schedules" in caplog.text
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP OWNED BY {r}").format(**ident))
            conn.execute(sql.SQL("DROP ROLE {r}").format(**ident))


def test_a_dispatcher_serving_targets_declares_its_schedules_in_each(
        dsn: str, schema: str) -> None:
    d = outbox.Dispatcher(effects=[Recording()], targets=[outbox.Target(dsn, schema)],
                          schedules=[outbox.Schedule("nightly", effect=EFFECT,
                                                     cron="0 3 * * *")])
    d.run_until_idle(timeout=30)
    [(name, source)] = rows(dsn, "SELECT name, source FROM {s}.schedules", schema)
    assert (name, source) == ("nightly", "code")


def test_the_async_dispatcher_enqueues_the_due_slots_in_run_until_idle(
        dsn: str, schema: str) -> None:
    clock = Clock(utc(2026, 12, 5, 2, 59))
    effect = Recording()
    d = outbox.AsyncDispatcher(dsn, effects=[effect], schema=schema, schedules=[
        outbox.Schedule("nightly", effect=EFFECT, cron="0 3 * * *", catch_up="all")])
    d._schedule_clock = clock
    asyncio.run(d.run_until_idle(timeout=30))
    clock.at = utc(2026, 12, 7, 3, 0, 1)  # three nights: the 5th, the 6th, the 7th
    stats = asyncio.run(d.run_until_idle(timeout=30))
    assert stats.done == 3
    assert sorted(j.scheduled_for for j in effect.jobs if j.scheduled_for) == [
        utc(2026, 12, day, 3) for day in (5, 6, 7)]
