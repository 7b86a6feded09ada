"""What the provider answers decides the job: outages retry, refusals fail, once each.

Failure windows: provider down, slow or 5xx (retries with backoff, done when it
returns); provider rejects permanently (failed with the reason, no retry); payload invalid
for the effect (failed with a clear message); effect unknown to the dispatcher (pending).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import outbox
from outbox import Dispatcher, DispatchStats
from outbox.testing import jobs, ledger

from .provider import VALIDATED_EFFECT, Conn, Provider, TableEffect, ValidatedEffect
from .support import drain, enqueue, job, wait_until


@contextmanager
def running(dispatcher: Dispatcher) -> Iterator[list[DispatchStats]]:
    """``dispatcher.run()`` in a thread for the block; stopped and joined after it."""
    result: list[DispatchStats] = []
    thread = threading.Thread(target=lambda: result.append(dispatcher.run()), name="run")
    thread.start()
    try:
        yield result
    finally:
        dispatcher.stop()
        thread.join(timeout=60)
        assert not thread.is_alive(), "run() did not return after stop()"


def test_provider_down_then_5xx_then_timing_out_is_retried_until_it_returns(
    dsn: str, schema: str, db: Conn, provider: Provider, effect: TableEffect,
) -> None:
    keys = [f"k{i}" for i in range(5)]
    provider.set_mode("down")
    enqueue(db, schema, keys, {"switch": True})
    # The breaker off: this test follows each job's own retries through every phase
    # (tests/limits shows the breaker pausing the effect instead).
    dispatcher = Dispatcher(dsn, [effect], schema=schema, lease=5.0, poll_interval=0.05,
                            backoff=outbox.Backoff(base=0.02, cap=0.05), breaker_threshold=None)
    phases = [("down", "Retry: provider down"),
              ("5xx", "RuntimeError: provider answered HTTP 503"),
              ("timeout", "UnknownOutcome: provider timed out")]
    with running(dispatcher) as result:
        for mode, error in phases:
            provider.set_mode(mode)
            before = {k: j["attempts"] for k, j in jobs(db, schema).items()}

            def retried(error: str = error, before: dict[str, int] = before) -> bool:
                now = jobs(db, schema)
                return all(j["status"] == "pending" and j["attempts"] >= before[k] + 2
                           and (j["last_error"] or "").startswith(error) for k, j in now.items())

            wait_until(retried, f"every job to be retried twice with {error!r}")
            if mode != "timeout":
                assert provider.performed() == {}, "nothing reaches a provider that is down"
        provider.set_mode("up")
        wait_until(lambda: {j["status"] for j in jobs(db, schema).values()} == {"done"},
                   "every job done once the provider is back")
    stats = result[0]
    assert (stats.done, stats.failed, stats.reconcile) == (5, 0, 0)
    done = jobs(db, schema)
    assert all(j["attempts"] >= 7 and j["last_error"] is None for j in done.values())
    # The timeouts happened after the provider acted: redelivered, deduplicated.
    assert all(n >= 2 for n in provider.performed().values())
    assert sorted(provider.acted()) == sorted(ledger(db, schema)) == keys


def test_provider_rejection_fails_at_once_with_the_reason(
    dsn: str, schema: str, db: Conn, provider: Provider,
) -> None:
    reason = "card_declined (HTTP 402): insufficient_funds"
    enqueue(db, schema, ["declined"], {"reject": reason})
    stats = drain(dsn, schema)
    assert (stats.claimed, stats.failed, stats.retried) == (1, 1, 0)
    failed = job(db, schema, "declined")
    assert (failed["status"], failed["attempts"]) == ("failed", 1)
    assert reason in failed["last_error"]
    assert (ledger(db, schema), provider.performed()) == ({}, {})


def test_invalid_payload_fails_with_a_message_naming_the_field(
    dsn: str, schema: str, db: Conn,
) -> None:
    enqueue(db, schema, ["wrong-type"], {"amount": "a lot", "currency": "eur"},
            effect=VALIDATED_EFFECT)
    enqueue(db, schema, ["missing"], {"amount": 100}, effect=VALIDATED_EFFECT)
    enqueue(db, schema, ["fine"], {"amount": 100, "currency": "eur"}, effect=VALIDATED_EFFECT)
    effect = ValidatedEffect()
    stats = Dispatcher(dsn, [effect], schema=schema).run_until_idle(timeout=30)
    assert (stats.done, stats.failed, stats.retried) == (1, 2, 0)
    assert effect.performed == ["fine"], "an invalid payload never reaches perform()"

    by_key = jobs(db, schema)
    for key, field in (("wrong-type", "amount"), ("missing", "currency")):
        failed = by_key[key]
        assert (failed["status"], failed["attempts"]) == ("failed", 1)
        assert field in failed["last_error"] and VALIDATED_EFFECT in failed["last_error"]
    assert "a lot" not in by_key["wrong-type"]["last_error"], "payload values stay out of errors"
    assert sorted(ledger(db, schema)) == ["fine"]


def test_effect_unknown_to_the_dispatcher_stays_pending(
    dsn: str, schema: str, db: Conn, provider: Provider,
) -> None:
    enqueue(db, schema, ["theirs"], effect="somebody.else")
    enqueue(db, schema, ["ours"])
    stats = drain(dsn, schema)
    assert (stats.claimed, stats.done) == (1, 1)
    theirs = job(db, schema, "theirs")
    assert (theirs["status"], theirs["attempts"], theirs["claim_version"]) == ("pending", 0, 0)
    assert (theirs["claimed_by"], theirs["last_error"]) == (None, None)
    assert provider.performed() == {"ours": 1}
