"""Provider limits against real PostgreSQL, real HTTP fakes and real processes: budgets
shared by every dispatcher, throttling that never fails a job, the breaker's pause and
probe, and limited effects that never hold back the others."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from datetime import timedelta

import psycopg
import pytest

import outbox
import outbox.sql
from effects.email import SendEmail
from effects.testing import FakeEmailProvider

from .support import (
    EMAIL,
    assert_within_rate,
    enqueue,
    finish,
    first_claims,
    limit_row,
    max_overlap,
    rows,
    start_workers,
    status_counts,
    wait_until,
)
from .worker import TRACE_EFFECT, create_trace_table

# Claim times come from the database's clock, as the budget's do; this is the slack for
# the rounding of the bucket's arithmetic, not for timing noise.
EPSILON = timedelta(milliseconds=5)


class Noop(outbox.Effect):
    """Succeeds at once."""

    def __init__(self, name: str) -> None:
        self.name = name  # type: ignore[misc]

    def perform(self, job: outbox.Job) -> None:
        return None


@pytest.fixture
def fake() -> Iterator[FakeEmailProvider]:
    with FakeEmailProvider() as provider:
        yield provider


def test_three_processes_share_one_rate(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_trace_table(conn, schema)
    enqueue(dsn, schema, TRACE_EFFECT, [f"t{i}" for i in range(30)])
    # Each process alone could perform 3 * 2 / 0.2 = 30 per second: only the shared
    # budget keeps the three of them to 10.
    workers = start_workers(3, dsn, schema, "--effect", "trace", "--seconds", "0.2",
                            "--concurrency", "6", "--limit", "10/s,burst=3", "--together", "3")
    finish(workers)
    assert status_counts(dsn, schema) == {"done": 30}
    assert_within_rate(first_claims(dsn, schema, TRACE_EFFECT), rate=10.0, burst=3.0, slack=EPSILON)
    pids = {r[0] for r in rows(dsn, "SELECT DISTINCT pid FROM {schema}.limit_trace", schema)}
    assert len(pids) >= 2, "the budget was not shared: one process did all the work"


def test_concurrency_is_counted_across_processes(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_trace_table(conn, schema)
    enqueue(dsn, schema, TRACE_EFFECT, [f"t{i}" for i in range(18)])
    # One perform at a time per process, none claimed ahead: the limit's second slot can
    # only be another process's, so the count must span processes to hold.
    workers = start_workers(3, dsn, schema, "--effect", "trace", "--seconds", "0.3",
                            "--concurrency", "1", "--prefetch", "0", "--limit", "concurrency=2",
                            "--together", "3")
    finish(workers)
    assert status_counts(dsn, schema) == {"done": 18}
    traced = rows(dsn, "SELECT started, ended, pid FROM {schema}.limit_trace", schema)
    assert len(traced) == 18
    assert max_overlap([(s, e) for s, e, _ in traced]) <= 2
    assert len({pid for _, _, pid in traced}) >= 2


def test_throttling_never_fails_a_job(dsn: str, schema: str) -> None:
    keys = [f"email-{i}" for i in range(40)]
    # Two attempts each: had a throttle counted, most of these jobs would end failed.
    enqueue(dsn, schema, "email.send", keys, payload=EMAIL, max_attempts=2)
    with FakeEmailProvider(rate_limit=8.0) as fake, SendEmail(
            "re_test", base_url=fake.url) as email:
        stats = outbox.Dispatcher(dsn, [email], schema=schema).run_until_idle(timeout=60)
        assert fake.throttled > 0, "the provider never throttled: nothing was tested"
        assert all(fake.performed(key) == 1 for key in keys)
    assert stats.failed == 0
    assert status_counts(dsn, schema) == {"done": 40}
    # Only a failure other than throttling (a transport error, say) may have counted one.
    assert rows(dsn, "SELECT max(attempts) FROM {schema}.jobs", schema)[0][0] <= 1 + stats.retried
    state = limit_row(dsn, schema, "email.send")
    assert state is not None and state["throttled_total"] == fake.throttled
    assert state["learned_rate"] == 8.0  # told by the 429s' ratelimit-limit


def test_a_throttle_pauses_the_effect_for_every_dispatcher(
        dsn: str, schema: str, fake: FakeEmailProvider) -> None:
    enqueue(dsn, schema, "email.send", [f"email-{i}" for i in range(60)], payload=EMAIL)
    fake.set_latency(0.05)
    workers = start_workers(3, dsn, schema, "--effect", "email", "--url", fake.url,
                            "--concurrency", "2")
    wait_until(lambda: len(fake.sent_emails) >= 5, "the first emails")
    fake.fail_next(1, 429, retry_after=2)
    wait_until(lambda: (limit_row(dsn, schema, "email.send") or {}).get("throttled_at"),
               "the throttle to be written")
    finish(workers)
    state = limit_row(dsn, schema, "email.send")
    assert state is not None
    throttled_at, paused_until = state["throttled_at"], state["paused_until"]
    assert paused_until >= throttled_at + timedelta(seconds=2)
    # Jobs claimed before the pause was written may still start just after it (a
    # process learns of the pause at its next claim round); after that nothing is sent,
    # by any of the three, until the pause ends.
    grace = throttled_at.timestamp() + 1.0
    during = [e for e in fake.sent_emails if grace < e.sent_at < paused_until.timestamp()]
    assert during == []
    assert status_counts(dsn, schema) == {"done": 60}


def test_breaker_pauses_probes_once_and_recovers(
        dsn: str, schema: str, fake: FakeEmailProvider) -> None:
    keys = [f"email-{i}" for i in range(40)]
    enqueue(dsn, schema, "email.send", keys, payload=EMAIL)
    fake.set_outage(True)
    with SendEmail("re_test", base_url=fake.url) as email:
        dispatcher = outbox.Dispatcher(dsn, [email], schema=schema, concurrency=4,
                                       poll_interval=0.1)
        runner = threading.Thread(target=dispatcher.run)
        runner.start()
        try:
            def opened(n: int) -> bool:
                return bool((limit_row(dsn, schema, "email.send") or {}).get("opened", 0) >= n)

            wait_until(lambda: opened(2), "a failed probe to reopen the breaker")
            before = fake.total_requests
            wait_until(lambda: opened(3), "the next probe to fail")
            assert fake.total_requests - before == 1, "one probe job tests recovery"
            # Waiting behind the open breaker burns no attempts: jobs never sent are at 0.
            untried = rows(dsn, "SELECT count(*) FROM {schema}.jobs WHERE attempts = 0",
                           schema)[0][0]
            assert untried >= len(keys) - fake.total_requests
            fake.set_outage(False)
            wait_until(lambda: status_counts(dsn, schema) == {"done": 40}, "recovery")
        finally:
            dispatcher.stop()
            runner.join()
    assert all(fake.performed(key) == 1 for key in keys)
    state = limit_row(dsn, schema, "email.send")
    assert state is not None and state["opened"] == 0 and state["pause_reason"] is None


def test_unknown_outcome_keeps_its_window_under_the_breaker(dsn: str, schema: str) -> None:
    class Vague(outbox.Effect):
        name = "vague"
        unknown_outcome_window = 0.0

        def perform(self, job: outbox.Job) -> None:
            raise outbox.UnknownOutcome("timed out after sending")

    enqueue(dsn, schema, "vague", [f"v{i}" for i in range(8)])
    stats = outbox.Dispatcher(dsn, [Vague()], schema=schema).run_until_idle(timeout=60)
    # Past the provider's window (0 s) every job goes to reconcile, breaker or not.
    assert stats.reconcile == 8
    assert status_counts(dsn, schema) == {"reconcile": 8}


def test_a_limited_backlog_never_holds_back_other_effects(dsn: str, schema: str) -> None:
    enqueue(dsn, schema, "email.send", [f"email-{i}" for i in range(3000)], payload=EMAIL)
    enqueue(dsn, schema, "payment.charge", [f"charge-{i}" for i in range(20)])

    class SlowEmail(outbox.Effect):
        name = "email.send"

        def perform(self, job: outbox.Job) -> None:
            return None

    dispatcher = outbox.Dispatcher(
        dsn, [SlowEmail(), Noop("payment.charge")], schema=schema, poll_interval=0.1,
        limits={"email.send": outbox.Limit(rate=2.0)})
    runner = threading.Thread(target=dispatcher.run)
    runner.start()
    try:
        wait_until(lambda: status_counts(dsn, schema, "payment.charge") == {"done": 20},
                   "every charge")
        emails = status_counts(dsn, schema, "email.send")
    finally:
        dispatcher.stop()
        runner.join()
    assert emails.get("pending", 0) > 2900, emails


def test_an_operator_pause_holds_one_effect_and_not_the_others(dsn: str, schema: str) -> None:
    enqueue(dsn, schema, "email.send", [f"email-{i}" for i in range(10)])
    enqueue(dsn, schema, "payment.charge", [f"charge-{i}" for i in range(10)])
    queries = outbox.sql.queries(schema)
    channel = outbox.sql.notify_channel(schema)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(queries.limit_pause, {"effect": "email.send", "seconds": None,
                                           "actor": "test"})
    dispatcher = outbox.Dispatcher(dsn, [Noop("email.send"), Noop("payment.charge")],
                                   schema=schema)
    stats = dispatcher.run_until_idle(timeout=30)  # returns: a paused effect is not waited for
    assert stats.done == 10
    assert status_counts(dsn, schema, "email.send") == {"pending": 10}
    assert rows(dsn, "SELECT max(attempts) FROM {schema}.jobs WHERE effect = 'email.send'",
                schema)[0][0] == 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        resumed = conn.execute(queries.limit_resume, {"effect": "email.send", "actor": "test",
                                                      "channel": channel}).fetchone()
    assert resumed == (1,)
    assert dispatcher.run_until_idle(timeout=30).done == 10


def test_async_dispatcher_claims_within_the_budget(dsn: str, schema: str) -> None:
    class AsyncNoop(outbox.Effect):
        name = "async.noop"

        async def perform(self, job: outbox.Job) -> None:
            return None

    enqueue(dsn, schema, "async.noop", [f"a{i}" for i in range(15)])
    dispatcher = outbox.AsyncDispatcher(dsn, [AsyncNoop()], schema=schema,
                                        limits={"async.noop": outbox.Limit(rate=10.0, burst=2)})
    stats = asyncio.run(dispatcher.run_until_idle(timeout=60))
    assert stats.done == 15
    assert_within_rate(first_claims(dsn, schema, "async.noop"), rate=10.0, burst=2.0, slack=EPSILON)


def test_an_effects_declared_limit_applies(dsn: str, schema: str) -> None:
    class Declared(outbox.Effect):
        name = "declared"
        limit = outbox.Limit(rate=10.0, burst=1)

        def perform(self, job: outbox.Job) -> None:
            return None

    enqueue(dsn, schema, "declared", [f"d{i}" for i in range(8)])
    assert outbox.Dispatcher(dsn, [Declared()], schema=schema).run_until_idle(timeout=60).done == 8
    assert_within_rate(first_claims(dsn, schema, "declared"), rate=10.0, burst=1.0, slack=EPSILON)


def test_limits_naming_an_unknown_effect_are_refused(dsn: str) -> None:
    with pytest.raises(outbox.ConfigurationError, match="does not run"):
        outbox.Dispatcher(dsn, [Noop("a")], limits={"b": outbox.Limit(rate=1)})
    with pytest.raises(outbox.ConfigurationError, match="outbox.Limit"):
        outbox.Dispatcher(dsn, [Noop("a")], limits={"a": 2.0})  # type: ignore[dict-item]
