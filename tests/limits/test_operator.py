"""Operators steer limits from the command line: pause, resume, status, and retries that
are audited and wake a listening dispatcher."""

from __future__ import annotations

import json
import threading
from typing import Any

import psycopg
from click.testing import CliRunner

import outbox
from outbox.cli import main

from .support import enqueue, limit_row, rows, status_counts, wait_until


class Noop(outbox.Effect):
    def __init__(self, name: str) -> None:
        self.name = name  # type: ignore[misc]

    def perform(self, job: outbox.Job) -> None:
        return None


def cli(dsn: str, schema: str, *args: str) -> str:
    result = CliRunner().invoke(main, [args[0], "--dsn", dsn, "--schema", schema, *args[1:]])
    assert result.exit_code == 0, result.output
    return result.output


def audit(dsn: str, schema: str) -> list[tuple[Any, ...]]:
    return rows(dsn, "SELECT actor, action, job_id, detail, affected "
                "FROM {schema}.dashboard_audit ORDER BY id", schema)


def test_pause_and_resume_are_audited_and_shown_by_status(dsn: str, schema: str) -> None:
    enqueue(dsn, schema, "email.send", ["welcome-1"])  # an effect with a pending job
    out = cli(dsn, schema, "pause", "email.send", "--for", "10m", "--actor", "ada")
    assert "paused for 10m" in out
    state = limit_row(dsn, schema, "email.send")
    assert state is not None and (state["pause_reason"], state["paused_by"]) == ("operator", "ada")

    report = json.loads(cli(dsn, schema, "status", "--json"))
    [paused] = report["paused_effects"]
    assert (paused["effect"], paused["reason"], paused["by"]) == ("email.send", "operator", "ada")
    assert 590 < paused["seconds_left"] <= 600
    assert "jobs" in report and "recent_failures" in report  # the existing fields stay
    assert "email.send: operator by ada" in cli(dsn, schema, "status")

    assert "resumed" in cli(dsn, schema, "resume", "email.send", "--actor", "ada")
    assert json.loads(cli(dsn, schema, "status", "--json"))["paused_effects"] == []
    assert "was not paused" in cli(dsn, schema, "resume", "email.send", "--actor", "ada")
    trail = audit(dsn, schema)
    assert [(a[0], a[1], a[4]) for a in trail] == [
        ("ada", "pause", 1), ("ada", "resume", 1), ("ada", "resume", 0)]
    assert trail[0][3] == {"effect": "email.send", "seconds": 600.0}


def test_pause_without_end_lasts_until_resumed(dsn: str, schema: str) -> None:
    cli(dsn, schema, "pause", "email.send", "--force")  # no job names it yet
    [paused] = json.loads(cli(dsn, schema, "status", "--json"))["paused_effects"]
    assert paused["until"] is None and paused["by"].startswith("cli")
    assert paused["seconds_left"] is None
    assert "email.send: operator by cli" in (text := cli(dsn, schema, "status"))
    assert "until resumed" in text


def test_a_pause_of_an_effect_nothing_names_is_refused_unless_forced(
        dsn: str, schema: str) -> None:
    enqueue(dsn, schema, "email.send", ["welcome-1"])
    with psycopg.connect(dsn, autocommit=True) as conn:  # a dispatcher serving another one
        conn.execute(f'INSERT INTO "{schema}".dispatchers (worker_id, effects, expires_at) '
                     "VALUES ('w1', ARRAY['payment.charge'], now() + interval '1 minute')")
    typo = CliRunner().invoke(main, ["pause", "--dsn", dsn, "--schema", schema, "emial.send"])
    assert typo.exit_code == 2, typo.output
    assert "no unfinished job, dispatcher or limit names effect 'emial.send'" in typo.output
    assert "payment.charge" in typo.output and "--force" in typo.output
    assert limit_row(dsn, schema, "emial.send") is None, "nothing was paused"
    assert audit(dsn, schema) == []
    assert "paused until resumed" in cli(dsn, schema, "pause", "email.send")  # a pending job
    assert "paused until resumed" in cli(dsn, schema, "pause", "payment.charge")  # served
    assert "paused until resumed" in cli(dsn, schema, "pause", "emial.send", "--force")


def test_a_bad_duration_is_refused_with_its_reason(dsn: str, schema: str) -> None:
    result = CliRunner().invoke(main, ["pause", "--dsn", dsn, "--schema", schema,
                                       "email.send", "--for", "soon"])
    assert result.exit_code != 0
    assert "not a duration like 90s, 10m or 2h" in result.output


def _fail(dsn: str, schema: str, error: str, keys: list[str], effect: str = "email.send") -> None:
    enqueue(dsn, schema, effect, keys)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'UPDATE "{schema}".jobs SET status = \'failed\', attempts = 25, '
                     "last_error = %s WHERE key = ANY(%s)", (error, keys))


def test_bulk_retry_by_effect_and_error_is_fenced_capped_and_audited(
        dsn: str, schema: str) -> None:
    _fail(dsn, schema, "Retry: Resend answered HTTP 503 (request req_8f2a9c1d)",
          [f"a{i}" for i in range(3)])
    _fail(dsn, schema, "Permanent: 422 validation_error", ["b0"])
    _fail(dsn, schema, "Retry: Resend answered HTTP 503", ["c0"], effect="payment.charge")
    out = cli(dsn, schema, "retry", "--effect", "email.send", "--error", "http 503",
              "--actor", "ada")
    assert "3 failed email.send job(s)" in out
    assert status_counts(dsn, schema, "email.send") == {"pending": 3, "failed": 1}
    assert status_counts(dsn, schema, "payment.charge") == {"failed": 1}
    [(actor, action, job_id, detail, affected)] = audit(dsn, schema)
    assert (actor, action, job_id, affected) == ("ada", "bulk_retry", None, 3)
    assert detail["filter"] == {"status": "failed", "effect": "email.send", "error": "http 503"}


class Performed(outbox.Effect):
    """Sets ``done`` when a job is performed: the test awaits it instead of polling."""

    name = "noop"

    def __init__(self) -> None:
        self.done = threading.Event()

    def perform(self, job: outbox.Job) -> None:
        self.done.set()


def test_retry_of_one_job_is_audited_and_wakes_a_listening_dispatcher(
        dsn: str, schema: str) -> None:
    _fail(dsn, schema, "Permanent: 422 validation_error", ["x"], effect="noop")
    job_id = rows(dsn, "SELECT id FROM {schema}.jobs", schema)[0][0]
    effect = Performed()
    # Polling once an hour: only the notification can wake it in time.
    dispatcher = outbox.Dispatcher(dsn, [effect], schema=schema, poll_interval=3600)
    runner = threading.Thread(target=dispatcher.run)
    runner.start()
    try:
        # Another process's LISTEN has no event to await: its session is seen idle in it.
        wait_until(lambda: rows(dsn, "SELECT count(*) FROM pg_stat_activity WHERE "
                                "query ILIKE 'LISTEN%%' AND state = 'idle'", schema)[0][0] > 0,
                   "the dispatcher to listen")
        assert not effect.done.is_set()
        out = cli(dsn, schema, "retry", str(job_id), "--actor", "ada")
        assert f"job {job_id} (noop, key x) is pending again" in out
        assert effect.done.wait(timeout=30), "the retried job was not performed at once"
    finally:
        dispatcher.stop()
        runner.join()
    assert status_counts(dsn, schema) == {"done": 1}
    [(actor, action, audited_job, detail, affected)] = audit(dsn, schema)
    assert (actor, action, audited_job, affected) == ("ada", "retry", job_id, 1)
    assert detail == {"via": "command line"}


def test_run_takes_limits_on_the_command_line(dsn: str, schema: str, tmp_path: object) -> None:
    from outbox.cli import _limits

    assert _limits(("email.send=2/s", "payment.charge=concurrency=4")) == {
        "email.send": outbox.Limit(rate=2.0), "payment.charge": outbox.Limit(concurrency=4)}
    dispatcher = outbox.Dispatcher(dsn, [Noop("email.send")], schema=schema)
    dispatcher.add_limits(_limits(("email.send=10/s,burst=1",)))
    assert dispatcher.settings.limits == {"email.send": outbox.Limit(rate=10.0, burst=1.0)}
    result = CliRunner().invoke(main, ["run", "nowhere:d", "--limit", "email.send"])
    assert result.exit_code != 0 and "EFFECT=LIMIT" in result.output
