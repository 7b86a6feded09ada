"""What is reported of a claim an operator cancelled after its outcome was decided, before
that was written: the decision ``settle`` wrote, not the one first taken.

The recorder decides a retry (``_lifecycle.settle``); an operator then cancels the claim,
through the real operator path on another connection, before the settling statement
runs, which writes it failed (``_lifecycle.cancelled_meanwhile``) and answers so. The run's
counters (``DispatchStats``) and the observer's events (``attempt_finished``,
``recorded``) must say failed, never retried: for ``Dispatcher`` and ``AsyncDispatcher``,
on the recorder's batched path and on the completion hooks' path (an ``on_failed`` that
raised, its retry decided then cancelled).
"""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest

import outbox
from outbox import AsyncDispatcher, Dispatcher, Effect, Job, NewJob, _lifecycle
from outbox._dispatch.settling import as_written, reported, settle_claim
from outbox._lifecycle import Decision
from outbox.observe import AttemptOutcome, DispatchObserver

from .test_cancelled_meanwhile import HookRaises, RetriesLater, _cancel, _row


class Heard(DispatchObserver):
    """The recorder's events about attempts."""

    def __init__(self) -> None:
        self.finished: list[tuple[str, AttemptOutcome]] = []
        self.batches: list[tuple[AttemptOutcome, int]] = []

    def attempt_finished(self, effect: str, outcome: AttemptOutcome, duration: float) -> None:
        self.finished.append((effect, outcome))

    def recorded(self, outcome: AttemptOutcome, count: int) -> None:
        self.batches.append((outcome, count))


def _dispatch(kind: str, dsn: str, schema: str, effect: Effect,
              heard: Heard) -> outbox.DispatchStats:
    if kind == "sync":
        return Dispatcher(dsn, [effect], schema=schema, observer=heard).run_until_idle(
            timeout=60)
    dispatcher = AsyncDispatcher(dsn, [effect], schema=schema, observer=heard)
    return asyncio.run(dispatcher.run_until_idle(timeout=60))


def _cancelled_once_decided(dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch, *,
                            hooked: bool) -> tuple[list[Decision], list[dict[str, Any]]]:
    """``_lifecycle.settle`` replaced by the real one that, once it decided (after the
    hook raised, when ``hooked``), has the job cancelled by an operator."""
    real = _lifecycle.settle
    decided: list[Decision] = []
    at_cancel: list[dict[str, Any]] = []

    def settle(*args: Any, **kwargs: Any) -> Decision:
        decision = real(*args, **kwargs)
        if (kwargs.get("hook_error") is not None) == hooked:
            decided.append(decision)
            at_cancel.append(_cancel(dsn, schema, "k"))
        return decision

    monkeypatch.setattr(_lifecycle, "settle", settle)
    return decided, at_cancel


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("hooked", [False, True], ids=["batched", "hooked"])
def test_a_retry_cancelled_before_it_is_written_is_reported_failed(
    dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch, kind: str, hooked: bool,
) -> None:
    effect: Effect = HookRaises() if hooked else RetriesLater()
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue_many([NewJob(effect.name, "k", {}, max_attempts=5)])
    decided, at_cancel = _cancelled_once_decided(dsn, schema, monkeypatch, hooked=hooked)
    heard = Heard()
    stats = _dispatch(kind, dsn, schema, effect, heard)
    [decision], [before] = decided, at_cancel
    assert decision.status == "pending"  # a retry, decided
    assert before["cancel_version"] == before["claim_version"]  # then cancelled
    with psycopg.connect(dsn, autocommit=True) as conn:
        after = _row(conn, schema, "k")
    assert after["status"] == "failed"  # written as cancelled_meanwhile decides
    assert after["last_error"] == _lifecycle.cancelled_meanwhile(decision).error
    # Reported as written: one attempt, failed; no retry anywhere.
    assert (stats.failed, stats.retried, stats.stale_completions) == (1, 0, 0)
    assert heard.finished == [(effect.name, "failed")]
    assert heard.batches == [("failed", 1)]


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_retry_nobody_cancelled_is_still_reported_a_retry(
    dsn: str, schema: str, kind: str,
) -> None:
    # The same run without the cancel: the retry is written and reported as one (the
    # job then waits an hour, so the run ends idle after one attempt).
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue_many([NewJob(RetriesLater.name, "k", {}, max_attempts=5)])
    heard = Heard()
    stats = _dispatch(kind, dsn, schema, RetriesLater(), heard)
    assert (stats.failed, stats.retried) == (0, 1)
    assert heard.finished == [(RetriesLater.name, "retry")]
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert _row(conn, schema, "k")["status"] == "pending"


@pytest.mark.parametrize(("decision", "refund", "cancelled", "outcome"), [
    (Decision("pending", delay=5.0, error="Retry: later"), False, False, "retry"),
    (Decision("pending", delay=5.0, error="Retry: later"), False, True, "failed"),
    (Decision("pending"), True, False, "released"),  # a release (or Throttled)
    (Decision("pending"), True, True, "failed"),  # never performed, the cancel stands
    (Decision("reconcile", error="UnknownOutcome: x"), False, True, "reconcile"),
    (Decision("failed", error="Permanent: no"), False, True, "failed"),
])
def test_what_settle_answered_decides_what_is_reported(
    decision: Decision, refund: bool, cancelled: bool, outcome: AttemptOutcome,
) -> None:
    job = Job(id=1, effect="e", key="k", payload={}, attempt=1, claim_version=1)
    claim = settle_claim(job, decision, refund=refund)
    wrote = as_written(claim, cancelled=cancelled)
    expected = (_lifecycle.cancelled_meanwhile(decision, released=refund) if cancelled
                else decision)
    assert (wrote.status, wrote.delay, wrote.error) == (
        expected.status, expected.delay, expected.error)
    assert reported(claim, cancelled=cancelled) == outcome
