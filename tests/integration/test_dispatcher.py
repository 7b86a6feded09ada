"""The dispatcher in-process against real PostgreSQL: outcomes, ledger, leases, wake-ups."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from typing import Any, ClassVar

import psycopg
import pytest
from pydantic import BaseModel

import outbox
import outbox.sql
from outbox import Dispatcher, Effect, Job, NewJob, Permanent, Retry, UnknownOutcome
from outbox.testing import jobs, ledger

from .helpers import fetch, running, wait_for_listener, wait_until


def enqueue(dsn: str, schema: str, *items: NewJob) -> None:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue_many(items)


class Recorder(Effect):
    """Counts calls per key; returns a result the ledger should hold."""

    name = "test.record"

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.lock = threading.Lock()

    def perform(self, job: Job) -> dict[str, Any]:
        with self.lock:
            self.calls[job.key] += 1
        return {"handled": job.key, "attempt": job.attempt}


class Scripted(Effect):
    """Raises the scripted outcome for each attempt, then succeeds."""

    name = "test.scripted"

    def __init__(self, script: list[BaseException]) -> None:
        self.script = script
        self.attempts: list[int] = []

    def perform(self, job: Job) -> None:
        self.attempts.append(job.attempt)
        if job.attempt <= len(self.script):
            raise self.script[job.attempt - 1]


def test_done_job_and_its_ledger_row(dsn: str, schema: str) -> None:
    enqueue(dsn, schema, NewJob("test.record", "email-order-102", {"to": "x"}))
    effect = Recorder()
    stats = Dispatcher(dsn, [effect], schema=schema).run_until_idle(timeout=30)
    assert (stats.claimed, stats.done) == (1, 1)
    job = jobs(dsn, schema)["email-order-102"]
    assert (job["status"], job["attempts"], job["claim_version"]) == ("done", 1, 1)
    assert (job["lease_until"], job["claimed_by"]) == (None, None)
    row = ledger(dsn, schema)["email-order-102"]
    assert row["result"] == {"handled": "email-order-102", "attempt": 1}
    assert (row["job_id"], row["claim_version"], row["effect"]) == (job["id"], 1, "test.record")
    assert effect.calls == {"email-order-102": 1}


def test_retry_then_success(dsn: str, schema: str) -> None:
    enqueue(dsn, schema, NewJob("test.scripted", "k", {}))
    effect = Scripted([Retry(after=0), RuntimeError("boom")])
    dispatcher = Dispatcher(dsn, [effect], schema=schema,
                            backoff=outbox.Backoff(base=0.001, cap=0.001))
    dispatcher.run_until_idle(timeout=30)
    job = jobs(dsn, schema)["k"]
    assert (job["status"], job["attempts"], job["claim_version"]) == ("done", 3, 3)
    assert effect.attempts == [1, 2, 3]
    assert "k" in ledger(dsn, schema)


@pytest.mark.parametrize(("signal", "error"), [
    (Retry("503", after=3600), "Retry: 503"),
    (Retry(3600), "Retry: retry requested"),  # the contract's Retry(after=None), positionally
])
def test_retry_after_delays_the_next_attempt(dsn: str, schema: str, signal: Retry,
                                             error: str) -> None:
    enqueue(dsn, schema, NewJob("test.scripted", "k", {}))
    stats = Dispatcher(dsn, [Scripted([signal])], schema=schema).run_until_idle(timeout=30)
    assert stats.retried == 1
    job = jobs(dsn, schema)["k"]
    assert (job["status"], job["last_error"]) == ("pending", error)
    query = f'SELECT extract(epoch FROM available_at - now()) FROM "{schema}".jobs'
    (delay,) = fetch(dsn, query)[0]
    assert 3500 < delay <= 3600


class ThrottledTimes(Effect):
    """Refused for load (``Throttled``) ``times`` times, then performed; the attempt
    number of each call recorded."""

    name = "test.throttled"

    def __init__(self, times: int) -> None:
        self.times = times
        self.attempts: list[int] = []

    def perform(self, job: Job) -> None:
        self.attempts.append(job.attempt)
        if len(self.attempts) <= self.times:
            raise outbox.Throttled(0.05, "429 from the provider")


def test_a_throttle_spends_no_attempt(dsn: str, schema: str) -> None:
    # A 429 is "nothing done, come back later": not a failure of the job, so its claim
    # is given back. With one attempt allowed, three throttles and then a success.
    enqueue(dsn, schema, NewJob("test.throttled", "k", {}, max_attempts=1))
    effect = ThrottledTimes(3)
    dispatcher = Dispatcher(dsn, [effect], schema=schema, poll_interval=0.05)
    with running(dispatcher):
        wait_until(lambda: jobs(dsn, schema)["k"]["status"] == "done",
                   what="the job done after three throttles")
    assert effect.attempts == [1, 1, 1, 1], "each throttled claim was refunded"
    job = jobs(dsn, schema)["k"]
    assert (job["attempts"], job["claim_version"]) == (1, 4)  # four claims, one attempt
    assert dispatcher.stats.failed == 0


def test_permanent_fails_without_retry(dsn: str, schema: str) -> None:
    enqueue(dsn, schema, NewJob("test.scripted", "k", {}))
    effect = Scripted([Permanent("card_declined: insufficient_funds")])
    stats = Dispatcher(dsn, [effect], schema=schema).run_until_idle(timeout=30)
    assert stats.failed == 1
    job = jobs(dsn, schema)["k"]
    assert (job["status"], job["attempts"]) == ("failed", 1)
    assert job["last_error"] == "Permanent: card_declined: insufficient_funds"
    assert ledger(dsn, schema) == {}


def test_attempts_exhausted_fails_with_last_error(dsn: str, schema: str) -> None:
    enqueue(dsn, schema, NewJob("test.scripted", "k", {}, max_attempts=3))
    effect = Scripted([ValueError("a"), ValueError("b"), ValueError("c"), ValueError("d")])
    Dispatcher(dsn, [effect], schema=schema,
               backoff=outbox.Backoff(base=0.0001, cap=0.0001)).run_until_idle(timeout=30)
    job = jobs(dsn, schema)["k"]
    assert (job["status"], job["attempts"]) == ("failed", 3)
    assert job["last_error"] == "ValueError: c (attempt 3 of 3)"


def test_unknown_outcome_goes_to_reconcile_past_the_window(dsn: str, schema: str) -> None:
    enqueue(dsn, schema, NewJob("test.scripted", "k", {}))
    effect = Scripted([UnknownOutcome("timeout after send")] * 5)
    Dispatcher(dsn, [effect], schema=schema, unknown_outcome_window=0).run_until_idle(timeout=30)
    job = jobs(dsn, schema)["k"]
    assert (job["status"], job["attempts"]) == ("reconcile", 1)
    assert "UnknownOutcome: timeout after send" in job["last_error"]


def test_unknown_outcome_retries_with_the_same_key_inside_the_window(dsn: str, schema: str) -> None:
    enqueue(dsn, schema, NewJob("test.scripted", "k", {}))
    keys: list[str] = []

    class Flaky(Scripted):
        def perform(self, job: Job) -> None:
            keys.append(job.key)
            super().perform(job)

    Dispatcher(dsn, [Flaky([UnknownOutcome("dropped", after=0)])],
               schema=schema).run_until_idle(timeout=30)
    assert keys == ["k", "k"]
    assert jobs(dsn, schema)["k"]["status"] == "done"


def test_unknown_effect_stays_pending(dsn: str, schema: str) -> None:
    enqueue(dsn, schema, NewJob("nobody.handles", "k", {}), NewJob("test.record", "r", {}))
    stats = Dispatcher(dsn, [Recorder()], schema=schema).run_until_idle(timeout=30)
    assert stats.claimed == 1
    job = jobs(dsn, schema)["k"]
    assert (job["status"], job["attempts"], job["claim_version"]) == ("pending", 0, 0)


class Email(BaseModel):
    to: str
    subject: str


class Validated(Effect):
    name = "test.validated"
    payload_model: ClassVar[type[BaseModel] | None] = Email

    def __init__(self) -> None:
        self.seen: list[Any] = []

    def perform(self, job: Job) -> None:
        self.seen.append(job.model)


def test_invalid_payload_fails_with_the_field_named(dsn: str, schema: str) -> None:
    enqueue(dsn, schema, NewJob("test.validated", "bad", {"to": "a@b.c", "secret": "x"}),
            NewJob("test.validated", "good", {"to": "a@b.c", "subject": "hi"}))
    effect = Validated()
    Dispatcher(dsn, [effect], schema=schema).run_until_idle(timeout=30)
    found = jobs(dsn, schema)
    assert (found["bad"]["status"], found["bad"]["attempts"]) == ("failed", 1)
    assert found["bad"]["last_error"] == (
        "Permanent: payload invalid for effect 'test.validated': subject: Field required")
    assert found["good"]["status"] == "done"
    assert effect.seen == [Email(to="a@b.c", subject="hi")]


class AsyncEffect(Effect):
    name = "test.async"

    def __init__(self) -> None:
        self.running = 0
        self.peak = 0

    async def perform(self, job: Job) -> dict[str, int]:
        self.running += 1
        self.peak = max(self.peak, self.running)
        await asyncio.sleep(0.01)
        self.running -= 1
        return {"n": job.payload["n"]}


def test_async_effects_run_concurrently_within_the_limit(dsn: str, schema: str) -> None:
    enqueue(dsn, schema, *[NewJob("test.async", f"a-{n}", {"n": n}) for n in range(60)])
    effect = AsyncEffect()
    stats = Dispatcher(dsn, [effect], schema=schema, concurrency=8).run_until_idle(timeout=30)
    assert stats.done == 60
    assert 1 < effect.peak <= 8
    assert ledger(dsn, schema)["a-7"]["result"] == {"n": 7}


def test_ordering_key_runs_one_at_a_time_in_enqueue_order(dsn: str, schema: str) -> None:
    order: list[str] = []
    running: Counter[str] = Counter()
    overlaps: list[str] = []
    lock = threading.Lock()

    class Ordered(Effect):
        name = "test.ordered"

        def perform(self, job: Job) -> None:
            with lock:
                running[job.ordering_key or ""] += 1
                if running[job.ordering_key or ""] > 1:
                    overlaps.append(job.key)
                order.append(job.key)
            time.sleep(0.002)
            with lock:
                running[job.ordering_key or ""] -= 1

    items = [NewJob("test.ordered", f"{c}-{i}", {}, ordering_key=c)
             for i in range(15) for c in ("cust-a", "cust-b")]
    enqueue(dsn, schema, *items)
    Dispatcher(dsn, [Ordered()], schema=schema, concurrency=8).run_until_idle(timeout=60)
    assert overlaps == []
    for customer in ("cust-a", "cust-b"):
        expected = [f"{customer}-{i}" for i in range(15)]
        assert [k for k in order if k.startswith(customer)] == expected


def test_a_failed_job_does_not_block_its_ordering_key(dsn: str, schema: str) -> None:
    enqueue(dsn, schema, NewJob("test.scripted", "first", {}, ordering_key="c"),
            NewJob("test.record", "second", {}, ordering_key="c"))
    Dispatcher(dsn, [Scripted([Permanent("no")]), Recorder()],
               schema=schema).run_until_idle(timeout=30)
    found = jobs(dsn, schema)
    assert (found["first"]["status"], found["second"]["status"]) == ("failed", "done")


def test_due_later_jobs_are_not_claimed(dsn: str, schema: str) -> None:
    from datetime import timedelta

    enqueue(dsn, schema, NewJob("test.record", "later", {}, run_at=timedelta(hours=1)))
    assert Dispatcher(dsn, [Recorder()], schema=schema).run_until_idle(timeout=30).claimed == 0


def test_expired_lease_is_rescued_and_performed(dsn: str, schema: str) -> None:
    enqueue(dsn, schema, NewJob("test.record", "k", {}))
    with psycopg.connect(dsn, autocommit=True) as conn:  # a worker that claimed, then died
        conn.execute(outbox.sql.queries(schema).claim, {
            "effects": ["test.record"], "limit": 10, "lease": 1.0, "worker": "dead", "after": "{}"})
    effect = Recorder()
    stats = Dispatcher(dsn, [effect], schema=schema, lease=1).run_until_idle(timeout=30)
    assert (stats.rescued, stats.done) == (1, 1)
    job = jobs(dsn, schema)["k"]
    assert (job["status"], job["attempts"], job["claim_version"]) == ("done", 2, 2)
    assert ledger(dsn, schema)["k"]["claim_version"] == 2


def test_crashing_worker_jobs_reach_reconcile(dsn: str, schema: str) -> None:
    """A worker that died on the last attempt may have acted: an unknown outcome, with
    the attempts used up, goes to reconcile (as an UnknownOutcome raised does)."""
    enqueue(dsn, schema, NewJob("test.record", "k", {}, max_attempts=1))
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(outbox.sql.queries(schema).claim, {
            "effects": ["test.record"], "limit": 10, "lease": 1.0, "worker": "dead", "after": "{}"})
    effect = Recorder()
    Dispatcher(dsn, [effect], schema=schema, lease=1).run_until_idle(timeout=30)
    job = jobs(dsn, schema)["k"]
    assert job["status"] == "reconcile"
    assert "lease expired on attempt 1 of 1" in job["last_error"]
    assert job["last_error"].endswith("(attempts exhausted)")
    assert effect.calls == {}


def test_heartbeat_keeps_a_slow_effect_claimed(dsn: str, schema: str) -> None:
    class Slow(Effect):
        name = "test.slow"

        def perform(self, job: Job) -> None:
            time.sleep(2.5)

    enqueue(dsn, schema, NewJob("test.slow", "k", {}))
    stats = Dispatcher(dsn, [Slow()], schema=schema, lease=1).run_until_idle(timeout=30)
    assert (stats.done, stats.lost_claims, stats.rescued) == (1, 0, 0)
    job = jobs(dsn, schema)["k"]
    assert (job["attempts"], job["claim_version"]) == (1, 1)


def test_run_wakes_on_notify_and_stops_cleanly(dsn: str, schema: str) -> None:
    effect = Recorder()
    dispatcher = Dispatcher(dsn, [effect], schema=schema, poll_interval=3600)
    result: list[outbox.DispatchStats] = []
    thread = threading.Thread(target=lambda: result.append(dispatcher.run()))
    thread.start()
    try:
        wait_for_listener(dsn)
        enqueue(dsn, schema, NewJob("test.record", "k", {}))
        # Polling is an hour away: only the notification can make this happen in time.
        wait_until(lambda: effect.calls["k"] == 1, timeout=20, what="job performed")
    finally:
        dispatcher.stop()
        thread.join(timeout=30)
    assert not thread.is_alive()
    assert result[0].done == 1


def test_stop_releases_unstarted_jobs_with_the_attempt_refunded(dsn: str, schema: str) -> None:
    started = threading.Event()
    release = threading.Event()

    class Blocking(Effect):
        name = "test.blocking"

        def perform(self, job: Job) -> None:
            started.set()
            release.wait(30)

    enqueue(dsn, schema, *[NewJob("test.blocking", f"k{i}", {}) for i in range(5)])
    dispatcher = Dispatcher(dsn, [Blocking()], schema=schema, concurrency=1, prefetch=1)
    result: list[outbox.DispatchStats] = []
    thread = threading.Thread(target=lambda: result.append(dispatcher.run()))
    thread.start()
    assert started.wait(30)
    dispatcher.stop()
    release.set()
    thread.join(timeout=30)
    statuses = Counter(j["status"] for j in jobs(dsn, schema).values())
    assert statuses == {"done": 1, "pending": 4}
    assert result[0].released == 1  # the prefetched job: claimed but never started
    assert all(j["attempts"] == 0 for j in jobs(dsn, schema).values() if j["status"] == "pending")


def test_retention_deletes_old_done_jobs_but_keeps_the_ledger(dsn: str, schema: str) -> None:
    enqueue(dsn, schema, NewJob("test.record", "old", {}), NewJob("test.record", "new", {}))
    Dispatcher(dsn, [Recorder()], schema=schema).run_until_idle(timeout=30)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"UPDATE \"{schema}\".jobs SET updated_at = now() - interval '8 days' "
                     "WHERE key = 'old'")
    dispatcher = Dispatcher(dsn, [Recorder()], schema=schema, retention=7 * 86400)
    thread = threading.Thread(target=dispatcher.run)
    thread.start()
    try:
        wait_until(lambda: "old" not in jobs(dsn, schema), what="retention")
    finally:
        dispatcher.stop()
        thread.join(30)
    assert set(jobs(dsn, schema)) == {"new"}
    assert set(ledger(dsn, schema)) == {"old", "new"}


def test_dispatcher_refuses_an_unmigrated_schema(dsn: str) -> None:
    with pytest.raises(outbox.SchemaError, match="run `outbox migrate`"):
        Dispatcher(dsn, [Recorder()], schema="never_migrated").run_until_idle(timeout=5)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"lease": 0.5}, "lease must be at least 1.0 seconds"),
    ({"concurrency": 0}, "concurrency must be a positive integer"),
    ({"schema": ""}, "schema name must be a non-empty string"),
    ({"retention": 10, "ledger_retention": 5}, "ledger_retention must not be shorter"),
])
def test_bad_configuration_is_refused(dsn: str, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(outbox.ConfigurationError, match=message):
        Dispatcher(dsn, [Recorder()], **kwargs)


def test_effects_need_distinct_names(dsn: str) -> None:
    with pytest.raises(outbox.ConfigurationError, match="two effects are named 'test.record'"):
        Dispatcher(dsn, [Recorder(), Recorder()])


def test_lease_accepts_a_timedelta(dsn: str) -> None:
    from datetime import timedelta

    assert Dispatcher(dsn, [Recorder()], lease=timedelta(seconds=2)).lease == 2.0
