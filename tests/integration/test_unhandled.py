"""Nothing waits in silence: dispatchers record the effects they serve (a heartbeat row),
warn about due jobs of effects no running dispatcher handles, and ``outbox status`` and
the metrics show the backlog per effect with those effects flagged."""

from __future__ import annotations

import asyncio
import json
import logging
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from click.testing import CliRunner
from psycopg import sql

import outbox
from outbox import AsyncDispatcher, Dispatcher, Effect, Job, NewJob
from outbox.cli import main
from outbox.testing import jobs

from .helpers import fetch, running, table, wait_until


class Send(Effect):
    name = "email.send"

    def __init__(self) -> None:
        self.seen: list[str] = []

    def perform(self, job: Job) -> None:
        self.seen.append(job.key)


class Typo(Effect):
    name = "email.sned"

    def perform(self, job: Job) -> None:
        return None


def enqueue(dsn: str, schema: str, *items: NewJob) -> None:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue_many(items)


def warnings_about(caplog: pytest.LogCaptureFixture, effect: str) -> list[str]:
    """The dispatchers' warnings naming ``effect`` (not enqueue's own typo hint, which
    tests/integration/test_misspelt_effect.py covers)."""
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and r.name == "outbox.dispatcher"
            and repr(effect) in r.getMessage()]


def dispatchers(dsn: str, schema: str) -> dict[str, list[str]]:
    rows = fetch(dsn, sql.SQL("SELECT worker_id, effects FROM {} WHERE expires_at > now()")
                 .format(table(schema, "dispatchers")))
    return {worker: list(effects) for worker, effects in rows}


def test_a_due_job_of_an_unhandled_effect_is_warned_about_by_name(
    dsn: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    enqueue(dsn, schema, NewJob("email.sned", "typo-1", {}), NewJob("email.sned", "typo-2", {}),
            NewJob("email.send", "ok-1", {}))
    effect = Send()
    with caplog.at_level(logging.WARNING, logger="outbox.dispatcher"):
        stats = Dispatcher(dsn, [effect], schema=schema).run_until_idle(timeout=30)
    assert (stats.done, effect.seen) == (1, ["ok-1"])
    [warning] = warnings_about(caplog, "email.sned")
    assert warning.startswith("2 due job(s) of effect 'email.sned'")
    assert "handles email.send" in warning
    assert "did you mean 'email.send'?" in warning  # the served name closest to the typo
    assert warnings_about(caplog, "email.send") == [warning]  # none about email.send itself
    assert jobs(dsn, schema)["typo-1"]["status"] == "pending"  # still waits, but not silently


def test_the_async_dispatcher_warns_too(
    dsn: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    enqueue(dsn, schema, NewJob("email.sned", "typo-1", {}))
    with caplog.at_level(logging.WARNING, logger="outbox.dispatcher"):
        asyncio.run(AsyncDispatcher(dsn, [Send()], schema=schema).run_until_idle(timeout=30))
    assert len(warnings_about(caplog, "email.sned")) == 1


def test_an_effect_another_running_dispatcher_handles_is_not_warned_about(
    dsn: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    enqueue(dsn, schema, NewJob("email.sned", "typo-1", {}))
    # Another dispatcher process, busy, that serves the effect: its heartbeat row.
    rows = table(schema, "dispatchers")
    fetch(dsn, sql.SQL("INSERT INTO {} (worker_id, effects, expires_at) VALUES "
                       "('elsewhere', '{{email.sned}}', now() + interval '1 minute') "
                       "RETURNING 1").format(rows))
    with caplog.at_level(logging.WARNING, logger="outbox.dispatcher"):
        Dispatcher(dsn, [Send()], schema=schema).run_until_idle(timeout=30)
    assert warnings_about(caplog, "email.sned") == []
    # Its heartbeat stopped (the process died): the jobs wait for nobody.
    fetch(dsn, sql.SQL("UPDATE {} SET expires_at = now() - interval '1 second' "
                       "RETURNING 1").format(rows))
    with caplog.at_level(logging.WARNING, logger="outbox.dispatcher"):
        Dispatcher(dsn, [Send()], schema=schema).run_until_idle(timeout=30)
    assert len(warnings_about(caplog, "email.sned")) == 1


def test_a_running_dispatcher_has_a_heartbeat_row_until_it_stops(dsn: str, schema: str) -> None:
    dispatcher = Dispatcher(dsn, [Send(), Typo()], schema=schema, poll_interval=0.2)
    with running(dispatcher):
        wait_until(lambda: dispatcher.worker_id in dispatchers(dsn, schema),
                   what="the dispatcher's heartbeat row")
        assert dispatchers(dsn, schema)[dispatcher.worker_id] == ["email.send", "email.sned"]
    assert dispatchers(dsn, schema) == {}


def _in_an_hour() -> datetime:
    return datetime.now(UTC) + timedelta(hours=1)


def test_status_breaks_the_backlog_down_by_effect_and_flags_unhandled_ones(
    dsn: str, schema: str
) -> None:
    enqueue(dsn, schema, NewJob("email.sned", "typo-1", {}), NewJob("email.send", "ok-1", {}),
            NewJob("email.send", "ok-2", {}, run_at=_in_an_hour()))
    other = Dispatcher(dsn, [Send()], schema=schema, poll_interval=0.2)
    runner = CliRunner()
    args = ["status", "--dsn", dsn, "--schema", schema]
    with running(other):
        wait_until(lambda: jobs(dsn, schema)["ok-1"]["status"] == "done", what="ok-1 done")
        report = json.loads(runner.invoke(main, [*args, "--json"]).output)
        text = runner.invoke(main, args).output
    assert report["jobs"]["pending"] == 2  # the existing fields stay
    assert report["backlog_by_effect"]["email.sned"]["due"] == 1
    assert report["backlog_by_effect"]["email.sned"]["dispatchers"] == 0
    assert report["backlog_by_effect"]["email.send"] == {
        "pending": 1, "due": 0, "waiting_on_parents": 0, "oldest_due_age_seconds": None,
        "dispatchers": 1}
    assert report["unhandled_effects"] == ["email.sned"]
    assert [d["effects"] for d in report["dispatchers"]] == [["email.send"]]
    [flagged] = [line for line in text.splitlines() if "email.sned" in line]
    assert "no running dispatcher handles this effect" in flagged
    [served] = [line for line in text.splitlines() if "email.send " in line]
    assert "no running dispatcher" not in served


def test_the_metrics_count_due_jobs_no_dispatcher_handles(dsn: str, schema: str) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from outbox.metrics import DatabaseCollector

    enqueue(dsn, schema, NewJob("email.sned", "typo-1", {}), NewJob("email.sned", "typo-2", {}))
    registry = CollectorRegistry()
    registry.register(DatabaseCollector(dsn, schema))
    text = generate_latest(registry).decode()
    assert 'outbox_unhandled_due_jobs{effect="email.sned"} 2.0' in text


def test_a_fresh_typo_behind_a_large_older_backlog_is_found(dsn: str, schema: str) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from outbox.metrics import DatabaseCollector

    jobs_table, rows = table(schema, "jobs"), table(schema, "dispatchers")
    # More older due jobs of a served effect than the check reads from the oldest end.
    fetch(dsn, sql.SQL("INSERT INTO {} (effect, key, payload, fingerprint, available_at) "
                       "SELECT 'email.send', 'k' || g, '{{}}', 'f', now() - interval '1 hour' "
                       "FROM generate_series(1, 10050) g RETURNING 1").format(jobs_table))
    fetch(dsn, sql.SQL("INSERT INTO {} (worker_id, effects, expires_at) VALUES "
                       "('elsewhere', '{{email.send}}', now() + interval '1 minute') "
                       "RETURNING 1").format(rows))
    enqueue(dsn, schema, NewJob("email.sned", "typo-1", {}))
    registry = CollectorRegistry()
    registry.register(DatabaseCollector(dsn, schema))
    text = generate_latest(registry).decode()
    assert 'outbox_unhandled_due_jobs{effect="email.sned"} 1.0' in text
    assert 'outbox_unhandled_due_jobs{effect="email.send"} 0.0' in text  # served


def test_the_metrics_give_each_effects_largest_group_without_naming_it(
        dsn: str, schema: str) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from outbox.metrics import DatabaseCollector

    enqueue(dsn, schema, *[NewJob("email.send", f"acme-{n}", {}, group="acme") for n in range(3)],
            NewJob("email.send", "beta-1", {}, group="beta"),
            NewJob("sms.send", "plain-1", {}), NewJob("sms.send", "plain-2", {}))
    registry = CollectorRegistry()
    registry.register(DatabaseCollector(dsn, schema))
    text = generate_latest(registry).decode()
    assert 'outbox_busiest_group_pending{effect="email.send"} 3.0' in text
    assert 'outbox_busiest_group_pending{effect="sms.send"} 2.0' in text  # no group: one
    assert "acme" not in text, "a group's name is no label"
