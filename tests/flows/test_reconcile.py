"""Automatic reconciliation on real PostgreSQL, with Dispatcher and AsyncDispatcher.

``flow.lossy`` acts at its "provider" (a dict) and then loses the answer
(``UnknownOutcome``); with ``unknown_outcome_window=0`` every such job lands in
``reconcile`` at once, where ``reconcile`` looks the key up and answers.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from typing import Any

import psycopg
import pytest
from psycopg import sql

import outbox
from outbox import NewJob
from outbox.testing import jobs, ledger

from .shop import dispatch_once

LOSSY = "flow.lossy"
GIVE_UP_AFTER = 8  # answers of "still unknown" before the reconciler gives up (README)


class Provider:
    """What the provider did, per key, and how ``reconcile`` answers."""

    def __init__(self) -> None:
        self.acted: Counter[str] = Counter()
        self.asked: Counter[str] = Counter()
        self.answers: dict[str, str] = {}  # key -> "performed" (default), "none", "down", ...
        self.lock = threading.Lock()

    def reconcile(self, job: outbox.Job) -> outbox.Performed | outbox.NotPerformed | None:
        with self.lock:
            self.asked[job.key] += 1
            answer = self.answers.get(job.key, "lookup")
            acted = self.acted[job.key]
        if answer == "down":
            raise ConnectionError("provider unreachable")
        if answer == "none":
            return None
        if answer == "declined":
            raise outbox.Permanent("card declined (found by the reconciler)")
        if answer == "wrong":
            return "yes"  # type: ignore[return-value]
        if acted:
            return outbox.Performed({"id": f"pi_{job.key}", "found_by": "reconcile"})
        return outbox.NotPerformed()


class Lossy(outbox.Effect):
    name = LOSSY

    def __init__(self, provider: Provider, schema: str) -> None:
        self.provider = provider
        self.schema = schema
        self.done: list[tuple[str, Any]] = []

    def perform(self, job: outbox.Job) -> dict[str, Any]:
        provider, key = self.provider, job.key
        with provider.lock:
            if job.payload.get("never_act") and not provider.asked[key]:
                raise outbox.UnknownOutcome("timed out before the provider acted")
            provider.acted[key] += 1
            lost = job.payload.get("lose") and provider.acted[key] == 1
        if lost:
            raise outbox.UnknownOutcome("response lost after the provider acted",
                                        after=job.payload.get("after"))
        return {"id": f"pi_{key}"}

    def reconcile(self, job: outbox.Job) -> Any:
        return self.provider.reconcile(job)

    def on_done(self, tx: outbox.HookTransaction, job: outbox.Job, result: Any) -> None:
        self.done.append((job.key, result))
        tx.enqueue("flow.note", key=f"note-{job.key}", payload={"intent": result["id"]})


class AsyncLossy(Lossy):
    async def reconcile(self, job: outbox.Job) -> Any:
        await asyncio.sleep(0)
        return self.provider.reconcile(job)

    async def on_done(self, tx: outbox.AsyncHookTransaction, job: outbox.Job,  # type: ignore[override]
                      result: Any) -> None:
        self.done.append((job.key, result))
        await tx.enqueue("flow.note", key=f"note-{job.key}", payload={"intent": result["id"]})


class Note(outbox.Effect):
    name = "flow.note"

    def perform(self, job: outbox.Job) -> None:
        return None


def _enqueue(dsn: str, schema: str, *items: NewJob) -> None:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue_many(items)


def _run(flavour: str, dsn: str, schema: str, effect: Lossy,
         **options: Any) -> outbox.DispatchStats:
    # Every answer lost in a row would open the effect's breaker (an outage, for the
    # dispatcher): these tests follow the reconciler, so the breaker is off.
    options = {"schema": schema, "unknown_outcome_window": 0, "reconcile_interval": 0.05,
               "backoff": outbox.Backoff(base=0.001, cap=0.002), "breaker_threshold": None,
               **options}
    effects = [effect, Note()]
    return dispatch_once(flavour, dsn, effects, timeout=30, **options)


def _jobs(dsn: str, schema: str) -> dict[str, dict[str, Any]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return jobs(conn, schema)


def _ledger(dsn: str, schema: str) -> dict[str, dict[str, Any]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return ledger(conn, schema)


def _audit(dsn: str, schema: str) -> list[tuple[str, str, int, str, int]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(sql.SQL(
            "SELECT a.actor, a.action, a.job_id, a.detail->>'decision', a.affected"
            " FROM {}.dashboard_audit a ORDER BY a.id").format(sql.Identifier(schema))).fetchall()
    return [(r[0], r[1], r[2], r[3], r[4]) for r in rows]


def _wait_due(dsn: str, schema: str) -> None:
    """Make every job in reconcile due to be asked now (the backoff between asks is
    what ``next_ask`` is tested for; here the passes are what is under test)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("UPDATE {}.jobs SET reconcile_at = now() WHERE status = 'reconcile'"
                             " AND reconcile_at IS NOT NULL").format(sql.Identifier(schema)))


@pytest.fixture(params=["sync", "async"])
def flavour(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _effect(flavour: str, provider: Provider, schema: str) -> Lossy:
    return (AsyncLossy if flavour == "async" else Lossy)(provider, schema)


def test_performed_settles_done_with_ledger_hook_and_audit(
    dsn: str, schema: str, flavour: str,
) -> None:
    provider = Provider()
    effect = _effect(flavour, provider, schema)
    _enqueue(dsn, schema, NewJob(LOSSY, "order-1", {"lose": True}))
    _run(flavour, dsn, schema, effect)  # the lost answer: reconcile
    assert _jobs(dsn, schema)["order-1"]["status"] == "reconcile"
    _run(flavour, dsn, schema, effect)  # the reconciler's pass, then its follow-up
    found = _jobs(dsn, schema)
    assert found["order-1"]["status"] == "done"
    assert found["note-order-1"]["status"] == "done"
    assert found["note-order-1"]["parent_key"] == "order-1"
    assert _ledger(dsn, schema)["order-1"]["result"] == {"id": "pi_order-1",
                                                         "found_by": "reconcile"}
    assert provider.acted["order-1"] == 1 and provider.asked["order-1"] == 1
    assert effect.done == [("order-1", {"id": "pi_order-1", "found_by": "reconcile"})]
    job_id = found["order-1"]["id"]
    assert _audit(dsn, schema) == [("reconciler", "reconcile", job_id, "performed", 1)]


def test_not_performed_goes_back_to_pending_under_the_same_key(
    dsn: str, schema: str, flavour: str,
) -> None:
    provider = Provider()
    effect = _effect(flavour, provider, schema)
    _enqueue(dsn, schema, NewJob(LOSSY, "order-2", {"never_act": True}))
    _run(flavour, dsn, schema, effect)
    assert _jobs(dsn, schema)["order-2"]["status"] == "reconcile"
    _run(flavour, dsn, schema, effect)  # not performed: pending, then performed here
    job = _jobs(dsn, schema)["order-2"]
    assert (job["status"], job["attempts"]) == ("done", 1)
    assert provider.acted["order-2"] == 1
    assert [d for _, _, _, d, _ in _audit(dsn, schema)] == ["not_performed"]


def test_unknown_answers_back_off_and_give_up_and_unreachable_passes_do_not_count(
    dsn: str, schema: str, flavour: str,
) -> None:
    provider = Provider()
    effect = _effect(flavour, provider, schema)
    provider.answers["order-3"] = "down"
    _enqueue(dsn, schema, NewJob(LOSSY, "order-3", {"lose": True}))
    _run(flavour, dsn, schema, effect)
    for _ in range(3):  # the provider is down: nothing counted, nothing audited
        _wait_due(dsn, schema)
        _run(flavour, dsn, schema, effect)
    job = _jobs(dsn, schema)["order-3"]
    assert (job["status"], job["reconcile_checks"]) == ("reconcile", 0)
    assert provider.asked["order-3"] == 3 and _audit(dsn, schema) == []

    provider.answers["order-3"] = "none"
    for n in range(1, GIVE_UP_AFTER + 1):
        _wait_due(dsn, schema)
        _run(flavour, dsn, schema, effect)
        assert _jobs(dsn, schema)["order-3"]["reconcile_checks"] == n
    job = _jobs(dsn, schema)["order-3"]
    assert job["status"] == "reconcile" and job["reconcile_at"] is None  # never again
    assert job["last_error"].startswith("reconciler gave up")
    decisions = [d for _, _, _, d, _ in _audit(dsn, schema)]
    assert decisions == ["unknown"] * (GIVE_UP_AFTER - 1) + ["gave_up"]
    _wait_due(dsn, schema)
    _run(flavour, dsn, schema, effect)
    assert provider.asked["order-3"] == 3 + GIVE_UP_AFTER  # a person decides now


def test_permanent_from_reconcile_fails_the_job(dsn: str, schema: str, flavour: str) -> None:
    provider = Provider()
    effect = _effect(flavour, provider, schema)
    provider.answers["order-4"] = "declined"
    provider.answers["order-5"] = "wrong"
    _enqueue(dsn, schema, NewJob(LOSSY, "order-4", {"lose": True}),
             NewJob(LOSSY, "order-5", {"lose": True}))
    _run(flavour, dsn, schema, effect)
    _run(flavour, dsn, schema, effect)
    found = _jobs(dsn, schema)
    assert found["order-4"]["status"] == "failed"
    assert "card declined (found by the reconciler)" in found["order-4"]["last_error"]
    # A reconcile that answers something else is a bug of the effect: not counted.
    assert (found["order-5"]["status"], found["order-5"]["reconcile_checks"]) == ("reconcile", 0)


def test_two_dispatchers_never_ask_about_the_same_job(dsn: str, schema: str) -> None:
    provider = Provider()
    _enqueue(dsn, schema, *(NewJob(LOSSY, f"k{n}", {"lose": True}) for n in range(150)))
    _run("sync", dsn, schema, Lossy(provider, schema))
    assert {j["status"] for j in _jobs(dsn, schema).values()} == {"reconcile"}
    barrier = threading.Barrier(2)

    class Slow(Lossy):
        def reconcile(self, job: outbox.Job) -> Any:
            time.sleep(0.002)  # a provider call: the other dispatcher runs meanwhile
            return super().reconcile(job)

    def dispatch() -> None:
        dispatcher = outbox.Dispatcher(dsn, [Slow(provider, schema), Note()], schema=schema,
                                       unknown_outcome_window=0, breaker_threshold=None)
        barrier.wait()
        dispatcher.run_until_idle(timeout=60)

    threads = [threading.Thread(target=dispatch) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(provider.asked.values()) == [1] * 150  # each asked once, by one of them
    assert {j["status"] for j in _jobs(dsn, schema).values()} == {"done"}
    assert all(provider.acted[f"k{n}"] == 1 for n in range(150))


def test_run_asks_within_the_interval(dsn: str, schema: str) -> None:
    provider = Provider()
    effect = Lossy(provider, schema)
    _enqueue(dsn, schema, NewJob(LOSSY, "order-6", {"lose": True}))
    dispatcher = outbox.Dispatcher(dsn, [effect, Note()], schema=schema,
                                   unknown_outcome_window=0, reconcile_interval=0.2,
                                   breaker_threshold=None)
    runner = threading.Thread(target=dispatcher.run)
    runner.start()
    try:
        deadline = time.monotonic() + 20
        while _jobs(dsn, schema).get("note-order-6", {}).get("status") != "done":
            assert time.monotonic() < deadline, _jobs(dsn, schema)
            time.sleep(0.05)
    finally:
        dispatcher.stop()
        runner.join()
    assert _jobs(dsn, schema)["order-6"]["status"] == "done"
    assert json.loads(json.dumps(_ledger(dsn, schema)["order-6"]["result"]))["found_by"]


def test_on_done_raising_after_reconciliation_keeps_the_answer(
    dsn: str, schema: str, flavour: str,
) -> None:
    provider = Provider()
    effect = _effect(flavour, provider, schema)
    original: Any = effect.on_done
    failures = [ValueError("the order table is locked")]

    def on_done(tx: Any, job: outbox.Job, result: Any) -> Any:
        if failures:
            raise failures.pop()
        return original(tx, job, result)

    effect.on_done = on_done  # type: ignore[method-assign]
    if flavour == "async":
        async def async_on_done(tx: Any, job: outbox.Job, result: Any) -> None:
            if failures:
                raise failures.pop()
            await original(tx, job, result)

        effect.on_done = async_on_done  # type: ignore[method-assign,assignment]
    _enqueue(dsn, schema, NewJob(LOSSY, "order-7", {"lose": True}))
    _run(flavour, dsn, schema, effect)
    _run(flavour, dsn, schema, effect)  # performed, but on_done raised: kept, pending
    _run(flavour, dsn, schema, effect)  # recorded from the kept answer
    found = _jobs(dsn, schema)
    assert found["order-7"]["status"] == "done"
    assert found["note-order-7"]["status"] == "done"
    assert provider.acted["order-7"] == 1  # never performed again
    assert _ledger(dsn, schema)["order-7"]["result"]["found_by"] == "reconcile"


def test_an_unknown_outcome_whose_retry_would_outlive_the_window_is_asked_first(
    dsn: str, schema: str, flavour: str,
) -> None:
    provider = Provider()
    effect = _effect(flavour, provider, schema)
    # The provider remembers keys for 60 s; the lost answer asks to come back in an hour.
    _enqueue(dsn, schema, NewJob(LOSSY, "order-8", {"lose": True, "after": 3600}))
    _run(flavour, dsn, schema, effect, unknown_outcome_window=60)
    job = _jobs(dsn, schema)["order-8"]
    assert job["status"] == "reconcile" and "the provider is asked instead" in job["last_error"]
    _run(flavour, dsn, schema, effect, unknown_outcome_window=60)
    assert _jobs(dsn, schema)["order-8"]["status"] == "done"
    assert provider.acted["order-8"] == 1

