"""``outbox schedules``: the list, pause and resume (not catching up the pause), removal,
and bad input, each change audited."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from click.testing import CliRunner
from psycopg import sql

import outbox
from outbox.cli import main

from .support import EFFECT, Recording


def cli(dsn: str, schema: str, *args: str, code: int = 0) -> Any:
    result = CliRunner().invoke(main, ["schedules", "--dsn", dsn, "--schema", schema, *args])
    assert result.exit_code == code, result.output
    return result


def audit(dsn: str, schema: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(sql.SQL(
            "SELECT action, detail ->> 'schedule', detail ->> 'via', affected "
            "FROM {}.dashboard_audit ORDER BY id").format(sql.Identifier(schema))).fetchall()


def test_list_shows_each_schedule_with_its_state(dsn: str, schema: str) -> None:
    assert cli(dsn, schema).output == "no schedules\n"
    clock = [datetime(2026, 12, 5, 2, 59, tzinfo=UTC)]
    d = outbox.Dispatcher(dsn, effects=[Recording()], schema=schema, schedules=[
        outbox.Schedule("nightly", effect=EFFECT, cron="0 3 * * *", timezone="Europe/Berlin")])
    d._schedule_clock = lambda: clock[0]
    d.run_until_idle(timeout=30)
    cli(dsn, schema, "add", "sweep", "--effect", EFFECT, "--every", "3600",
        "--payload", '{"provider": "stripe"}', "--catch-up", "all")
    clock[0] = datetime(2026, 12, 6, 2, 0, 5, tzinfo=UTC)
    d.run_until_idle(timeout=30)
    listed = {s["name"]: s for s in json.loads(cli(dsn, schema, "list", "--json").output)}
    nightly, sweep = listed["nightly"], listed["sweep"]
    assert (nightly["source"], nightly["when"], nightly["paused"]) == (
        "code", "cron 0 3 * * * Europe/Berlin", False)
    assert nightly["last_slot"] == "2026-12-06T02:00:00+00:00"
    assert nightly["next_slot"] == "2026-12-07T02:00:00+00:00"
    assert nightly["last_status"] == "done" and nightly["last_job_id"] is not None
    assert (sweep["source"], sweep["when"]) == ("stored", "every 3600s")
    lines = cli(dsn, schema).output.splitlines()
    assert lines[0].startswith(f"nightly: {EFFECT}, cron 0 3 * * * Europe/Berlin [code]; next ")
    assert "(job " in lines[0] and ": done)" in lines[0]


def test_pause_and_resume_do_not_catch_up_the_pause(dsn: str, schema: str) -> None:
    effect = Recording()
    clock = [datetime(2026, 12, 5, 10, 0, 30, tzinfo=UTC)]
    d = outbox.Dispatcher(dsn, effects=[effect], schema=schema, schedules=[
        outbox.Schedule("minutely", effect=EFFECT, cron="* * * * *", catch_up="all")])
    d._schedule_clock = lambda: clock[0]
    d.run_until_idle(timeout=30)
    assert cli(dsn, schema, "pause", "minutely", "--actor", "ops").output == (
        "schedule minutely paused\n")
    assert cli(dsn, schema, "pause", "minutely").output == "schedule minutely was already paused\n"
    clock[0] = datetime(2026, 12, 5, 10, 5, 30, tzinfo=UTC)
    d.run_until_idle(timeout=30)
    assert effect.jobs == []  # paused: nothing enqueued
    # The resume starts after the database's now, so move the fake clock there too.
    clock[0] = datetime.now(UTC)
    cli(dsn, schema, "resume", "minutely")
    d.run_until_idle(timeout=30)
    assert effect.jobs == []  # the pause's slots are not caught up
    with psycopg.connect(dsn, autocommit=True) as conn:
        [(next_slot,)] = conn.execute(sql.SQL("SELECT next_slot FROM {}.schedules").format(
            sql.Identifier(schema))).fetchall()
    assert clock[0] < next_slot <= clock[0].replace(second=0, microsecond=0) + timedelta(
        minutes=1)
    assert audit(dsn, schema) == [("schedule_pause", "minutely", "command line", 1),
                                  ("schedule_pause", "minutely", "command line", 0),
                                  ("schedule_resume", "minutely", "command line", 1)]


def test_remove_and_bad_input(dsn: str, schema: str) -> None:
    bad = cli(dsn, schema, "add", "nightly", "--effect", EFFECT, "--cron", "0 25 * * *", code=2)
    assert "schedule 'nightly': cron '0 25 * * *' is not a valid cron expression" in bad.output
    bad = cli(dsn, schema, "add", "nightly", "--effect", EFFECT, code=2)
    assert "give exactly one of cron= " in bad.output
    bad = cli(dsn, schema, "add", "n", "--effect", EFFECT, "--every", "1", "--payload", "[]",
              code=2)
    assert "must be a JSON object" in bad.output
    assert "no schedule 'nope'" in cli(dsn, schema, "remove", "nope", code=1).output
    assert "no schedule 'nope'" in cli(dsn, schema, "pause", "nope", code=1).output
    cli(dsn, schema, "add", "nightly", "--effect", EFFECT, "--cron", "0 3 * * *")
    assert cli(dsn, schema, "add", "nightly", "--effect", EFFECT, "--cron", "0 4 * * *"
               ).stdout.startswith("schedule nightly changed")
    assert cli(dsn, schema, "remove", "nightly").output == "schedule nightly removed\n"
    assert cli(dsn, schema).output == "no schedules\n"
    assert [a[0] for a in audit(dsn, schema)] == ["schedule_add", "schedule_change",
                                                  "schedule_remove"]


def test_adding_a_schedule_of_an_effect_nothing_serves_is_warned(dsn: str, schema: str) -> None:
    added = cli(dsn, schema, "add", "typo", "--effect", "sched.recrod", "--every", "60")
    assert "warning: no dispatcher serves effect 'sched.recrod'" in added.stderr
    assert "schedule typo added" in added.stdout
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue(EFFECT, key="k1", payload={})  # an unfinished job names the effect
    served = cli(dsn, schema, "add", "fine", "--effect", EFFECT, "--every", "60")
    assert served.stderr == ""
