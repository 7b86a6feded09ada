"""The one settlement of an outcome (``_state.settle`` and ``settle_answer``), without a
database: released and throttled attempts, the reconcile rule, hooks that raise, and the
reconciler's answers."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import outbox
from outbox import Backoff, Permanent, Throttled, UnknownOutcome
from outbox._lifecycle import (
    MAX_UNKNOWN_PASSES,
    NEVER,
    RELEASED,
    Decision,
    Rules,
    settle,
    settle_answer,
)

NOW = datetime(2026, 1, 1, tzinfo=UTC)
BACKOFF = Backoff(base=10.0, cap=10.0)
RULES = Rules(backoff=BACKOFF)


def _job(attempt: int = 2, max_attempts: int = 5, age: float = 0.0) -> outbox.Job:
    return outbox.Job(id=1, effect="payment.charge", key="k", payload={}, attempt=attempt,
                      claim_version=attempt, max_attempts=max_attempts,
                      first_attempted_at=NOW - timedelta(seconds=age))


def _settle(outcome: BaseException | None, job: outbox.Job | None = None,
            rules: Rules = RULES, *,
            hook_error: BaseException | None = None) -> Decision:
    return settle(outcome, job or _job(), rules, now=NOW, rng=random.Random(3),
                  hook_error=hook_error)


def test_a_returned_perform_is_done_and_a_released_one_pending_at_once() -> None:
    assert _settle(None) == Decision("done")
    assert settle(RELEASED, _job(), Rules(), now=NOW, rng=random.Random(0)) == Decision(
        "pending")


def test_throttled_is_due_again_at_once_even_with_its_attempts_spent() -> None:
    decision = _settle(Throttled(after=30.0), _job(attempt=5, max_attempts=5))
    assert decision == Decision("pending", 0.0, "Throttled: throttled by the provider")


def test_an_effect_that_reconciles_is_asked_before_the_window_closes() -> None:
    # 50 s into a 60 s window, the next retry (backoff up to 10 s) may come too late.
    late = Rules(window=60.0, backoff=Backoff(base=20.0, cap=20.0), reconciles=True)
    job = _job(age=50.0)
    rng = random.Random(0)
    assert late.backoff.delay(job.attempt, random.Random(0)) >= 10.0  # the premise
    decision = settle(UnknownOutcome("timeout"), job, late, now=NOW, rng=rng)
    assert decision.status == "reconcile"
    assert decision.error is not None and "the provider is asked instead" in decision.error
    # The same outcome without a reconciler is retried: the provider cannot be asked.
    plain = Rules(window=60.0, backoff=late.backoff)
    assert settle(UnknownOutcome("timeout"), job, plain, now=NOW,
                  rng=random.Random(0)).status == "pending"


def test_the_reconcile_rule_leaves_an_early_retry_and_other_errors_alone() -> None:
    rules = Rules(window=60.0, backoff=Backoff(base=1.0, cap=1.0), reconciles=True)
    assert _settle(UnknownOutcome("timeout"), _job(age=10.0), rules).status == "pending"
    assert _settle(RuntimeError("5xx"), _job(age=59.5), rules).status == "pending"
    assert _settle(Permanent("declined"), _job(age=10.0), rules).status == "failed"


def test_on_done_raising_retries_with_backoff_then_fails_never_reconciles() -> None:
    decision = _settle(None, hook_error=ValueError("no order row"))
    assert decision.status == "pending" and 0.0 <= decision.delay <= 10.0
    assert decision.error == "on_done raised ValueError: no order row"
    spent = _settle(None, _job(attempt=5, max_attempts=5), hook_error=ValueError("x"))
    assert spent == Decision("failed", error="on_done raised ValueError: x")
    told = _settle(None, hook_error=Permanent("bad order"))
    assert told.status == "failed" and told.error == "on_done raised Permanent: bad order"
    unknown = _settle(None, _job(age=10**6), Rules(window=1.0, reconciles=True),
                      hook_error=UnknownOutcome("db"))
    assert unknown.status == "pending"


def test_on_failed_raising_keeps_the_failure_it_was_told_of_in_the_error() -> None:
    decision = _settle(Permanent("declined"), hook_error=RuntimeError("audit down"))
    assert decision.status == "pending"
    assert decision.error == "Permanent: declined; on_failed raised RuntimeError: audit down"
    spent = _settle(Permanent("declined"), _job(attempt=5, max_attempts=5),
                    hook_error=RuntimeError("audit down"))
    assert spent.status == "failed" and spent.error == decision.error


def test_the_reconcilers_answers() -> None:
    assert settle_answer("performed") == Decision("done", ledger=True, clear_error=True)
    kept = settle_answer("performed", hook_error=KeyError("order"))
    assert kept == Decision("pending", error="on_done raised KeyError: 'order'", attempts=0)
    again = settle_answer("not_performed")
    assert again.status == "pending" and again.error is not None
    assert "no trace of this key" in again.error
    failed = settle_answer("failed", error=Permanent("closed"))
    assert failed == Decision("failed", error="Permanent: closed")
    stands = settle_answer("failed", error=Permanent("closed"), hook_error=OSError("x"))
    assert stands == Decision("failed", error="Permanent: closed; on_failed raised OSError: x")


def test_a_reconcile_answer_of_unknown_is_asked_again_until_a_person_must_decide() -> None:
    rng = random.Random(5)
    asked = settle_answer("unknown", checks=0, interval=60.0, rng=rng)
    assert asked.status == "reconcile" and 90.0 <= asked.delay <= 120.0  # 2 x 60 s, jitter
    assert asked.error is None
    last = settle_answer("unknown", checks=MAX_UNKNOWN_PASSES - 1, interval=60.0, rng=rng)
    assert last.status == "reconcile" and last.delay == NEVER
    assert last.error == (f"reconciler gave up: reconciler: still unknown after "
                          f"{MAX_UNKNOWN_PASSES} answer(s)")


def test_an_unreachable_provider_is_asked_again_without_counting_the_pass() -> None:
    down = ConnectionError("refused")
    again = settle_answer("unreachable", error=down, checks=MAX_UNKNOWN_PASSES - 1,
                          interval=60.0, rng=random.Random(5))
    assert again.status == "reconcile" and again.delay != NEVER and again.error is None
    over = settle_answer("unreachable", error=down, checks=MAX_UNKNOWN_PASSES,
                         interval=60.0, rng=random.Random(5))
    assert over.delay == NEVER
    assert over.error == "reconciler gave up: ConnectionError: refused"
