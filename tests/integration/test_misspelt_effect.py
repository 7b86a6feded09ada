"""A misspelt effect name is not accepted silently, without ``register_effects`` too.

``tx.enqueue("email.sned", ...)`` still commits (another process may run that effect,
and enqueue adds no query), but: a process that also built a dispatcher logs, at the
enqueue, one warning naming the close effect its dispatchers run; the dispatchers' warning
about due jobs nobody serves, ``outbox status`` and ``outbox schedules add`` each say
"did you mean" the served effect closest to the name."""

from __future__ import annotations

import json
import logging
import uuid

import psycopg
import pytest
from click.testing import CliRunner
from psycopg import sql

import outbox
from outbox import Dispatcher, Effect, Job
from outbox.cli import main
from outbox.testing import job

from .helpers import fetch, running, table, wait_until


def _effect(name: str) -> Effect:
    class Named(Effect):
        def perform(self, job: Job) -> None:
            return None

    Named.name = name
    return Named()


def _names() -> tuple[str, str]:
    """An effect name of this test's own and a typo of it (the registry of served names
    is the process's, shared by every test in it)."""
    base = f"mail{uuid.uuid4().hex[:6]}"
    return f"{base}.send", f"{base}.sned"


def _enqueue(dsn: str, schema: str, effect: str, key: str) -> outbox.EnqueueResult:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        return tx.enqueue(effect, key=key, payload={})


def test_enqueue_of_a_close_name_is_hinted_once_and_still_enqueued(
    dsn: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    served, typo = _names()
    Dispatcher(dsn, [_effect(served)], schema=schema)  # built in this process: served
    with caplog.at_level(logging.WARNING, logger="outbox"):
        first = _enqueue(dsn, schema, typo, "typo-1")
        _enqueue(dsn, schema, typo, "typo-2")          # the same name: no second hint
        _enqueue(dsn, schema, served, "ok-1")          # a served name: no hint
        _enqueue(dsn, schema, "audit.log", "far")  # nothing close: may be another process's
    # One warning in all: the typo's, once; none for the served or the distant name.
    [hint] = [r.getMessage() for r in caplog.records if r.name == "outbox"]
    assert hint.startswith(f"enqueued a job of effect {typo!r}, which no dispatcher of "
                           f"this process runs; did you mean {served!r}?"), hint
    assert "register_effects" in hint
    assert first.created  # enqueued all the same
    with psycopg.connect(dsn) as conn:
        found = job(conn, "typo-1", schema)
    assert found is not None and found["status"] == "pending"


def test_a_sibling_effect_enqueued_for_another_dispatcher_is_not_hinted(
    dsn: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A hook's child job of another dispatcher's effect (``billing.charge`` enqueued by
    the ``billing.nightly`` run) is alike in name but no slip: no hint. Nor for a name
    like no served one."""
    base = f"b{uuid.uuid4().hex[:6]}"
    Dispatcher(dsn, [_effect(f"{base}.nightly")], schema=schema)
    with caplog.at_level(logging.WARNING, logger="outbox"):
        _enqueue(dsn, schema, f"{base}.charge", "child")
        _enqueue(dsn, schema, f"zz{uuid.uuid4().hex}.export", "alone")
    assert not [r.getMessage() for r in caplog.records if r.name == "outbox"]


def _live(dsn: str, schema: str) -> list[str]:
    rows = fetch(dsn, sql.SQL("SELECT worker_id FROM {} WHERE expires_at > now()")
                 .format(table(schema, "dispatchers")))
    return [row[0] for row in rows]


def test_the_dispatcher_status_and_schedules_say_did_you_mean(
    dsn: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    served, typo = _names()
    _enqueue(dsn, schema, typo, "typo-1")
    dispatcher = Dispatcher(dsn, [_effect(served)], schema=schema, poll_interval=0.2)
    runner = CliRunner()
    with caplog.at_level(logging.WARNING, logger="outbox.dispatcher"), running(dispatcher):
        wait_until(lambda: dispatcher.worker_id in _live(dsn, schema),
                   what="the dispatcher's heartbeat row")
        wait_until(lambda: any("no running dispatcher handles" in m
                               for m in _hints_of(caplog, typo)), what="its warning")
        args = ["status", "--dsn", dsn, "--schema", schema]
        text = runner.invoke(main, args).output
        report = json.loads(runner.invoke(main, [*args, "--json"]).output)
        # Another slip of the served name, one no job names yet.
        slip = served.replace(".send", ".sedn")
        added = runner.invoke(main, ["schedules", "add", "nightly", "--dsn", dsn, "--schema",
                                     schema, "--effect", slip, "--every", "3600"])
    [warned] = [m for m in _hints_of(caplog, typo) if "no running dispatcher handles" in m]
    assert f"did you mean {served!r}?" in warned, warned

    [flagged] = [line for line in text.splitlines() if typo in line]
    assert flagged.endswith(f"<- no running dispatcher handles this effect; did you mean "
                            f"{served!r}?"), flagged
    assert report["did_you_mean"] == {typo: served}
    assert report["unhandled_effects"] == [typo]

    assert added.exit_code == 0, added.output
    assert f"warning: no dispatcher serves effect {slip!r}" in added.output
    assert f"did you mean {served!r}?" in added.output


def _hints_of(caplog: pytest.LogCaptureFixture, effect: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and repr(effect) in r.getMessage()]
