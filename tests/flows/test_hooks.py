"""Completion hooks on real PostgreSQL, with Dispatcher and AsyncDispatcher.

``sync``: Dispatcher with plain hooks; ``async``: AsyncDispatcher with ``async def``
hooks on its asyncio connection; ``async-plain``: AsyncDispatcher with plain hooks (run
on a thread with a blocking connection of their own).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest

import outbox
from outbox import NewJob
from outbox.testing import jobs, ledger

from .shop import (
    CHARGE,
    DECLINED,
    RECEIPT,
    AsyncCharge,
    Charge,
    Follow,
    create_tables,
    dispatch_once,
    rows,
)

FLAVOURS = ["sync", "async", "async-plain"]


@dataclass
class Shop:
    dsn: str
    schema: str
    flavour: str
    charge: Charge
    receipt: Follow
    declined: Follow

    def enqueue(self, *items: NewJob) -> None:
        with psycopg.connect(self.dsn) as conn, outbox.transaction(conn, schema=self.schema) as tx:
            tx.enqueue_many(items)

    def dispatch(self, **options: Any) -> outbox.DispatchStats:
        """Run until no job is pending (run_until_idle does not wait for retries that are
        not due yet); the counters summed over the runs."""
        effects = [self.charge, self.receipt, self.declined]
        options = {"schema": self.schema, "lease": 5.0, "concurrency": 8,
                   "backoff": outbox.Backoff(base=0.001, cap=0.005), **options}
        total = outbox.DispatchStats()
        for _ in range(20):
            stats = dispatch_once(self.flavour, self.dsn, effects, **options)
            for name, value in stats.as_dict().items():
                setattr(total, name, getattr(total, name) + value)
            if all(j["status"] not in ("pending", "running") for j in self.jobs().values()):
                return total
        raise AssertionError(f"jobs still pending after 20 runs: {self.jobs()}")

    def table(self, name: str) -> list[tuple[Any, ...]]:
        return rows(self.dsn, self.schema, name)

    def jobs(self) -> dict[str, dict[str, Any]]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            return jobs(conn, self.schema)

    def ledger(self) -> dict[str, dict[str, Any]]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            return ledger(conn, self.schema)


@pytest.fixture(params=FLAVOURS)
def shop(request: pytest.FixtureRequest, dsn: str, schema: str) -> Iterator[Shop]:
    create_tables(dsn, schema)
    charge = AsyncCharge(schema) if request.param == "async" else Charge(schema)
    yield Shop(dsn, schema, request.param, charge, Follow(RECEIPT), Follow(DECLINED))


def test_on_done_commits_business_row_follow_up_and_ledger_together(shop: Shop) -> None:
    shop.enqueue(NewJob(CHARGE, "order-1", {}), NewJob(CHARGE, "order-2", {}))
    stats = shop.dispatch()
    assert shop.table("paid") == [("order-1", "pi_order-1", 1), ("order-2", "pi_order-2", 1)]
    assert sorted(shop.receipt.performed) == ["receipt-order-1", "receipt-order-2"]
    found = shop.jobs()
    assert found["receipt-order-1"]["parent_key"] == "order-1"
    assert found["receipt-order-1"]["payload"] == {"intent": "pi_order-1"}
    assert found["order-1"]["status"] == "done" and found["order-1"]["parent_key"] is None
    assert shop.ledger()["order-1"]["result"]["id"] == "pi_order-1"
    assert stats.done == 4


def test_on_failed_runs_in_the_failed_transaction(shop: Shop) -> None:
    shop.enqueue(NewJob(CHARGE, "order-3", {"decline": True}))
    shop.dispatch()
    assert shop.table("declined") == [("order-3", "card declined")]
    assert shop.declined.performed == ["declined-order-3"]
    assert shop.table("paid") == []
    job = shop.jobs()["order-3"]
    assert job["status"] == "failed" and "card declined" in job["last_error"]
    assert "order-3" not in shop.ledger()


def test_a_hook_that_raises_after_writing_leaves_nothing_and_the_provider_is_not_asked_again(
    shop: Shop,
) -> None:
    shop.enqueue(NewJob(CHARGE, "order-4", {"hook": "raise_once"}))
    stats = shop.dispatch()
    # The first hook's row and follow-up rolled back; the second attempt reused the result.
    assert shop.table("paid") == [("order-4", "pi_order-4", 2)]
    assert shop.charge.performed["order-4"] == 1
    # A hook that raised is not called again for its attempt: the batch's first,
    # optimistic, transaction rolled back, its job is settled from the error it raised;
    # it runs again at the next attempt.
    assert shop.charge.hook_attempts["order-4"] == {1, 2}
    assert shop.charge.hook_calls["order-4"] == 2
    assert shop.receipt.performed == ["receipt-order-4"]
    assert stats.retried == 1 and stats.done == 2


def test_a_hook_that_always_raises_fails_the_job_with_its_error_and_keeps_the_result(
    shop: Shop,
) -> None:
    shop.enqueue(NewJob(CHARGE, "order-5", {"hook": "raise_always"}, max_attempts=3))
    stats = shop.dispatch()
    assert shop.charge.performed["order-5"] == 1
    assert shop.charge.hook_attempts["order-5"] == {1, 2, 3}
    assert shop.table("paid") == [] and shop.receipt.performed == []
    job = shop.jobs()["order-5"]
    assert job["status"] == "failed"
    assert job["last_error"].startswith("on_done raised HookFailed")
    assert "attempt 3" in job["last_error"]
    row = shop.ledger()["order-5"]
    assert row["result"]["id"] == "pi_order-5" and row["claim_version"] == 3
    assert stats.failed == 1 and stats.retried == 2


def test_a_hook_that_swallows_its_own_statement_error_is_a_failed_hook(shop: Shop) -> None:
    shop.enqueue(NewJob(CHARGE, "order-6", {"hook": "swallow"}, max_attempts=2))
    shop.dispatch()
    assert shop.table("paid") == []
    job = shop.jobs()["order-6"]
    assert job["status"] == "failed" and "transaction aborted" in job["last_error"]
    assert shop.charge.performed["order-6"] == 1


def test_a_hook_raising_inside_a_batch_of_500_disturbs_no_other_completion(shop: Shop) -> None:
    keys = [f"order-{n}" for n in range(500)]
    shop.enqueue(*(NewJob(CHARGE, key, {"hook": "raise_once"} if key == "order-250" else {})
                   for key in keys))
    stats = shop.dispatch(concurrency=16, batch_size=500)
    paid = shop.table("paid")
    assert sorted(k for k, _, _ in paid) == sorted(keys)  # each exactly once
    assert dict((k, a) for k, _, a in paid)["order-250"] == 2
    assert all(n == 1 for n in shop.charge.performed.values()) and len(shop.charge.performed) == 500
    assert len(shop.receipt.performed) == 500 == len(set(shop.receipt.performed))
    assert len(shop.ledger()) == 1000  # charges and receipts
    assert stats.retried == 1


def test_follow_ups_sharing_the_ordering_key_run_after_their_parent_in_order(shop: Shop) -> None:
    # Another job of the key enqueued first, so the chain waits behind it too.
    shop.enqueue(NewJob(CHARGE, "order-7", {}, ordering_key="customer-1"),
                 NewJob(RECEIPT, "note-customer-1", {}, ordering_key="customer-1"))
    seen: list[tuple[str, str]] = []
    original = shop.receipt.perform

    def perform(job: outbox.Job) -> dict[str, Any]:
        parent = shop.jobs()["order-7"]["status"]
        seen.append((job.key, parent))
        return original(job)

    shop.receipt.perform = perform  # type: ignore[method-assign]
    shop.dispatch()
    assert seen == [("note-customer-1", "done"), ("receipt-order-7", "done")]


def test_a_claim_fenced_off_while_performing_runs_no_hook(shop: Shop) -> None:
    shop.enqueue(NewJob(CHARGE, "order-8", {}))
    original = shop.charge.charge

    def charge(job: outbox.Job) -> dict[str, Any]:
        if job.attempt == 1:  # another worker takes the job over meanwhile
            with psycopg.connect(shop.dsn, autocommit=True) as conn:
                conn.execute(psycopg.sql.SQL(
                    "UPDATE {}.jobs SET claim_version = claim_version + 1, attempts = 2"
                    " WHERE key = 'order-8'").format(psycopg.sql.Identifier(shop.schema)))
        return original(job)

    shop.charge.charge = charge  # type: ignore[method-assign]
    stats = shop.dispatch(lease=1.0, rescue_interval=0.1)
    assert stats.stale_completions >= 1
    # The stale claim wrote nothing; the rescued claim's hook wrote once.
    assert [(k, a) for k, _, a in shop.table("paid")] == [("order-8", 3)]
    assert shop.receipt.performed == ["receipt-order-8"]


def test_hooks_given_to_the_dispatcher_by_effect_name(dsn: str, schema: str) -> None:
    create_tables(dsn, schema)
    follow = Follow("plain.effect")
    calls: list[tuple[str, Any]] = []

    def on_done(tx: outbox.HookTransaction, job: outbox.Job, result: Any) -> None:
        calls.append((job.key, result))
        tx.execute(psycopg.sql.SQL("INSERT INTO {}.paid VALUES (%s, 'x', 1)").format(
            psycopg.sql.Identifier(schema)), (job.key,))

    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue("plain.effect", key="k-1", payload={})
    outbox.Dispatcher(dsn, [follow], schema=schema, on_done={"plain.effect": on_done}
                      ).run_until_idle(timeout=30)
    assert calls == [("k-1", {"sent": "k-1"})]
    assert rows(dsn, schema, "paid") == [("k-1", "x", 1)]


def test_hook_options_are_checked(dsn: str) -> None:
    async def async_hook(tx: Any, job: Any, result: Any) -> None: ...

    with pytest.raises(outbox.ConfigurationError, match="async def: use outbox.AsyncDispatcher"):
        outbox.Dispatcher(dsn, [Follow("a")], on_done={"a": async_hook})
    with pytest.raises(outbox.ConfigurationError, match="names no effect"):
        outbox.Dispatcher(dsn, [Follow("a")], on_failed={"b": print})
    with pytest.raises(outbox.ConfigurationError, match="must be a function"):
        outbox.AsyncDispatcher(dsn, [Follow("a")], on_done={"a": 3})  # type: ignore[dict-item]
    assert outbox.AsyncDispatcher(dsn, [Follow("a")], on_done={"a": async_hook})


def test_on_failed_that_raises_is_retried_and_writes_once(shop: Shop) -> None:
    shop.enqueue(NewJob(CHARGE, "order-9", {"decline": True, "hook": "raise_once"}))
    shop.dispatch()
    assert shop.table("declined") == [("order-9", "card declined")]
    assert shop.declined.performed == ["declined-order-9"]
    # The provider is asked again with the same key (it replays its decline).
    assert shop.charge.performed["order-9"] == 2
    assert shop.charge.hook_attempts["order-9"] == {1, 2}
    job = shop.jobs()["order-9"]
    assert job["status"] == "failed" and job["last_error"].startswith("Permanent: card declined")


def test_on_failed_that_always_raises_fails_without_its_writes(shop: Shop) -> None:
    shop.enqueue(NewJob(CHARGE, "order-10", {"decline": True, "hook": "raise_always"},
                        max_attempts=2))
    shop.dispatch()
    assert shop.table("declined") == [] and shop.declined.performed == []
    job = shop.jobs()["order-10"]
    assert job["status"] == "failed"
    assert "card declined" in job["last_error"]
    assert "on_failed raised HookFailed" in job["last_error"]


def test_several_raising_hooks_in_one_chunk_each_retry_and_the_rest_are_written_once(
    shop: Shop,
) -> None:
    """The chunk written again after a hook raised (in segments, each in a savepoint,
    the raising jobs carefully): the other hooks' rows are kept once, each raising job
    is retried and done at its second attempt, nothing is performed twice."""
    raising = {"order-10", "order-11", "order-12", "order-40", "order-77"}
    shop.enqueue(*[NewJob(CHARGE, f"order-{i}",
                          {"hook": "raise_once"} if f"order-{i}" in raising else {})
                   for i in range(100)])
    stats = shop.dispatch(batch_size=100, concurrency=100)
    paid = shop.table("paid")
    assert sorted(key for key, _, _ in paid) == sorted(f"order-{i}" for i in range(100))
    assert {key: attempt for key, _, attempt in paid if attempt != 1} == dict.fromkeys(
        raising, 2)
    assert all(count == 1 for count in shop.charge.performed.values())
    assert len(shop.charge.performed) == 100
    assert sorted(shop.receipt.performed) == sorted(f"receipt-order-{i}" for i in range(100))
    assert {key for key, attempts in shop.charge.hook_attempts.items()
            if attempts != {1}} == raising
    assert stats.retried == len(raising) and stats.done == 200
    assert all(row["status"] == "done" for row in shop.jobs().values())
