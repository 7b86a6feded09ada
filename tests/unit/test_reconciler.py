"""The reconciler's pure parts: how a reply is read and when to ask next (where an
answer sends the job is ``_state.settle_answer``, tested in test_settlement)."""

from __future__ import annotations

import random

import outbox
from outbox._dispatch.reconciler import read_reply
from outbox._lifecycle import MAX_UNKNOWN_PASSES, next_ask

JOB = outbox.Job(id=1, effect="payment.charge", key="k", payload={}, attempt=2,
                 claim_version=2)


def test_next_ask_doubles_from_the_interval_is_capped_and_stops() -> None:
    rng = random.Random(1)
    delays = [next_ask(60.0, n, rng) for n in range(MAX_UNKNOWN_PASSES + 1)]
    assert delays[-1] is None
    for n, delay in enumerate(delays[:-1]):
        full = min(6 * 3600, 60 * 2**n)
        assert delay is not None and 0.75 * full <= delay <= full


def test_replies_are_read_as_answers() -> None:
    assert read_reply(JOB, 0, outbox.Performed({"id": "pi_1"}), None).result_json == '{"id":"pi_1"}'
    assert read_reply(JOB, 0, outbox.NotPerformed(), None).kind == "not_performed"
    assert read_reply(JOB, 3, None, None).kind == "unknown"
    assert read_reply(JOB, 0, None, outbox.Permanent("declined")).kind == "failed"
    assert read_reply(JOB, 0, None, ConnectionError("down")).kind == "unreachable"
    wrong = read_reply(JOB, 0, "yes", None)
    assert wrong.kind == "unreachable" and "expected outbox.Performed" in str(wrong.error)
