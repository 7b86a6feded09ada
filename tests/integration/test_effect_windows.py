"""An effect's own unknown-outcome window (its provider's idempotency window) decides,
for its jobs, both the recorder's settle and the rescuer's: real rows, real dispatchers."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

import outbox
from outbox import ConfigurationError, Effect, Job, NewJob, UnknownOutcome
from outbox.testing import jobs

DAY = 86400.0


class _Scripted(Effect):
    def __init__(self, outcome: BaseException | None = None) -> None:
        self.outcome = outcome
        self.performed: list[str] = []

    def perform(self, job: Job) -> None:
        self.performed.append(job.key)
        if self.outcome is not None:
            raise self.outcome


class Short(_Scripted):
    """A provider that remembers keys for one minute."""

    name = "window.short"
    unknown_outcome_window = timedelta(minutes=1)


class Plain(_Scripted):
    """Declares nothing: the dispatcher's window applies."""

    name = "window.plain"


class Long(_Scripted):
    """Learns its (two-day) window at run time, as a property."""

    name = "window.long"

    @property
    def unknown_outcome_window(self) -> float | None:
        return 2 * DAY


def _enqueue(dsn: str, schema: str, *effects: str) -> None:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue_many(NewJob(effect, effect, {}) for effect in effects)


def _first_attempted(dsn: str, schema: str, ago: float, *, expired_claim: bool) -> None:
    """Every job first attempted ``ago`` seconds back; with ``expired_claim``, also held
    by a worker that died (running, its lease over)."""
    running = (", status = 'running', attempts = 1, claim_version = 1, claimed_by = 'dead', "
               "lease_until = now() - interval '1 second'") if expired_claim else ""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("UPDATE {}.jobs SET first_attempted_at = now() - "
                             "make_interval(secs => %s)" + running).format(
                                 sql.Identifier(schema)), (ago,))


def _run(flavour: str, dsn: str, effects: list[Effect], **options: Any) -> outbox.DispatchStats:
    if flavour == "sync":
        return outbox.Dispatcher(dsn, effects, **options).run_until_idle(timeout=30)
    return asyncio.run(outbox.AsyncDispatcher(dsn, effects, **options).run_until_idle(30))


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_the_rescuer_sends_an_expired_claim_past_its_effects_window_to_reconcile(
    dsn: str, schema: str, flavour: str
) -> None:
    short, plain, long = Short(), Plain(), Long()
    _enqueue(dsn, schema, Short.name, Plain.name, Long.name)
    _first_attempted(dsn, schema, 600.0, expired_claim=True)  # ten minutes ago
    # The dispatcher's own window (five minutes) lies between the effects' two.
    stats = _run(flavour, dsn, [short, plain, long], schema=schema,
                 unknown_outcome_window=300.0)
    found = jobs(dsn, schema)
    assert found[Short.name]["status"] == "reconcile"
    assert found[Short.name]["last_error"].startswith(
        "UnknownOutcome: lease expired on attempt 1")
    assert "past the idempotency window" in found[Short.name]["last_error"]
    assert short.performed == []  # past the provider's memory: never sent again
    assert found[Plain.name]["status"] == "reconcile"  # the dispatcher's five minutes
    assert plain.performed == []
    assert found[Long.name]["status"] == "done"  # the effect's two days, though longer
    assert long.performed == [Long.name] and stats.rescued == 3


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_the_rescuer_retries_inside_the_effects_window_and_uses_the_default_otherwise(
    dsn: str, schema: str, flavour: str
) -> None:
    short, plain = Short(), Plain()
    _enqueue(dsn, schema, Short.name, Plain.name)
    _first_attempted(dsn, schema, 30.0, expired_claim=True)  # inside the minute
    stats = _run(flavour, dsn, [short, plain], schema=schema)  # default window: 24 h
    found = jobs(dsn, schema)
    assert {found[n]["status"] for n in (Short.name, Plain.name)} == {"done"}
    assert short.performed == [Short.name] and plain.performed == [Plain.name]
    assert stats.rescued == 2


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_an_unknown_outcome_is_settled_by_the_effects_window(
    dsn: str, schema: str, flavour: str
) -> None:
    timeout = UnknownOutcome("timeout after send", after=3600)
    effects: list[Effect] = [Short(timeout), Plain(timeout), Long(timeout)]
    _enqueue(dsn, schema, Short.name, Plain.name, Long.name)
    _first_attempted(dsn, schema, 600.0, expired_claim=False)
    stats = _run(flavour, dsn, effects, schema=schema, unknown_outcome_window=300.0)
    found = jobs(dsn, schema)
    assert found[Short.name]["status"] == "reconcile"
    assert "past the idempotency window" in found[Short.name]["last_error"]
    assert found[Plain.name]["status"] == "reconcile"  # the dispatcher's five minutes
    long = found[Long.name]
    assert (long["status"], long["attempts"]) == ("pending", 1)  # retried in an hour
    assert long["last_error"] == "UnknownOutcome: timeout after send"
    assert (stats.reconcile, stats.retried) == (2, 1)


def test_the_default_window_keeps_retrying_where_the_effect_declares_none(
    dsn: str, schema: str
) -> None:
    timeout = UnknownOutcome("timeout after send", after=3600)
    _enqueue(dsn, schema, Short.name, Plain.name)
    _first_attempted(dsn, schema, 600.0, expired_claim=False)
    _run("sync", dsn, [Short(timeout), Plain(timeout)], schema=schema)  # 24 h default
    found = jobs(dsn, schema)
    assert found[Short.name]["status"] == "reconcile"
    assert found[Plain.name]["status"] == "pending"


class _Bad(Effect):
    name = "window.bad"

    def perform(self, job: Job) -> None:
        raise AssertionError("never run")


@pytest.mark.parametrize(("value", "message"), [
    (-1.0, r"effect 'window\.bad': unknown_outcome_window must be at least 0"),
    ("1h", r"effect 'window\.bad': unknown_outcome_window must be seconds"),
    (float("nan"), r"effect 'window\.bad': unknown_outcome_window must be at least 0"),
])
@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_an_effects_bad_window_is_refused_naming_the_effect(
    dsn: str, value: object, message: str, flavour: str
) -> None:
    effect = type("Bad", (_Bad,), {"unknown_outcome_window": value})()
    cls = outbox.Dispatcher if flavour == "sync" else outbox.AsyncDispatcher
    with pytest.raises(ConfigurationError, match=message):
        cls(dsn, [effect])
