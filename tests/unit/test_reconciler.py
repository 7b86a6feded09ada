"""The reconciler's pure decisions: how an answer is read, when to ask next, and when an
unknown outcome is asked about before its window closes."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import outbox
from outbox._dispatch.reconciler import (
    MAX_UNKNOWN_PASSES,
    ask_before_window_closes,
    decide,
    next_ask,
)
from outbox._state import Decision

JOB = outbox.Job(id=1, effect="payment.charge", key="k", payload={}, attempt=2,
                 claim_version=2)


def test_next_ask_doubles_from_the_interval_is_capped_and_stops() -> None:
    rng = random.Random(1)
    delays = [next_ask(60.0, n, rng) for n in range(MAX_UNKNOWN_PASSES + 1)]
    assert delays[-1] is None
    for n, delay in enumerate(delays[:-1]):
        full = min(6 * 3600, 60 * 2**n)
        assert delay is not None and 0.75 * full <= delay <= full


def test_answers_are_read_as_decisions() -> None:
    assert decide(JOB, 0, outbox.Performed({"id": "pi_1"}), None).result_json == '{"id":"pi_1"}'
    assert decide(JOB, 0, outbox.NotPerformed(), None).kind == "not_performed"
    assert decide(JOB, 3, None, None).kind == "unknown"
    assert decide(JOB, 0, None, outbox.Permanent("declined")).kind == "failed"
    assert decide(JOB, 0, None, ConnectionError("down")).kind == "unreachable"
    wrong = decide(JOB, 0, "yes", None)
    assert wrong.kind == "unreachable" and "expected outbox.Performed" in str(wrong.error)


def test_ask_before_window_closes_only_when_the_retry_would_come_too_late() -> None:
    now = datetime.now(UTC)
    job = outbox.Job(id=1, effect="payment.charge", key="k", payload={}, attempt=2,
                     claim_version=2, first_attempted_at=now - timedelta(seconds=50))
    unknown = outbox.UnknownOutcome("timeout")
    soon = Decision("pending", delay=5.0, error="timeout")
    late = Decision("pending", delay=15.0, error="timeout")
    assert ask_before_window_closes(soon, unknown, job, 60.0, now) == soon
    assert ask_before_window_closes(late, unknown, job, 60.0, now).status == "reconcile"
    assert ask_before_window_closes(late, RuntimeError("5xx"), job, 60.0, now) == late
    failed = Decision("failed", error="declined")
    assert ask_before_window_closes(failed, unknown, job, 60.0, now) == failed
