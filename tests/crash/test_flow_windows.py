"""The failure windows of completion hooks, with real worker processes, kill -9 and
SIGSTOP, on Dispatcher and AsyncDispatcher.

The hook's effects on the business (a ``hooked`` row, a follow-up job) must happen once
per job: a worker killed between perform and record, or between the hook's writes and
the commit, leaves none of them; a worker frozen past its lease wakes to find its claim
fenced and runs no hook.
"""

from __future__ import annotations

import signal

import pytest

import outbox
from outbox.testing import ledger

from .flow_effect import create_hooked_table, drain_hooked, hooked
from .provider import EFFECT, Conn, Provider
from .support import (
    Workers,
    backend_gone,
    enqueue,
    job,
    lease_expired,
    poll_for,
    process_stopped,
    wait_until,
)

FLAVOURS = ["sync", "async"]


@pytest.fixture
def hooks_table(db: Conn, schema: str, provider: Provider) -> Provider:
    create_hooked_table(db, schema)
    return provider


def _paused(provider: Provider, point: str, pid: int) -> tuple[int, int]:
    """Wait for a worker ``pid`` to pause at ``point``; its (attempt, claim_version)."""
    return poll_for(lambda: next(((a, v) for _, p, a, v, w in provider.checkpoints(point)
                                  if w == pid), None), f"worker {pid} to pause {point}")


def _settled_once(dsn: str, db: Conn, schema: str, provider: Provider) -> None:
    """What must hold at the end of every window: the job done once, its hook's writes
    once, its follow-up once, one ledger row each, the provider acting once per key."""
    assert job(db, schema, "k")["status"] == "done"
    assert job(db, schema, "followup-k")["status"] == "done"
    assert [key for key, _ in hooked(db, schema)] == ["followup-k", "k"]
    assert sorted(ledger(db, schema)) == ["followup-k", "k"]
    assert set(provider.acted()) == {"k", "followup-k"}
    assert job(db, schema, "followup-k")["parent_key"] == "k"


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_killed_between_perform_and_record_the_hook_runs_once(
    dsn: str, schema: str, db: Conn, hooks_table: Provider, workers: Workers, flavour: str,
) -> None:
    enqueue(db, schema, ["k"], {"pause": {"1": "after"}})
    worker = workers.start("run", lease=1.0, flavour=flavour, hooks=1)
    assert _paused(hooks_table, "after", worker.pid) == (1, 1)
    worker.kill()
    assert hooked(db, schema) == []

    wait_until(lambda: lease_expired(db, schema, "k"), "the dead worker's lease to expire")
    stats = drain_hooked(dsn, schema)
    assert (stats.rescued, stats.done) == (1, 2)
    _settled_once(dsn, db, schema, hooks_table)
    assert hooked(db, schema) == [("followup-k", 1), ("k", 2)]
    assert hooks_table.performed()["k"] == 2  # delivered twice, acted once (same key)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_killed_between_the_hooks_writes_and_the_commit_none_of_them_land(
    dsn: str, schema: str, db: Conn, hooks_table: Provider, workers: Workers, flavour: str,
) -> None:
    enqueue(db, schema, ["k"], {"pause": {"1": "hook"}})
    worker = workers.start("run", lease=1.0, flavour=flavour, hooks=1)
    assert _paused(hooks_table, "hook", worker.pid) == (1, 1)
    # Mid-transaction: the done, the ledger row, the hook's row and the follow-up are
    # written but not committed; nothing of them is visible.
    assert job(db, schema, "k")["status"] == "running"
    assert hooked(db, schema) == [] and ledger(db, schema) == {}
    [(pid,)] = db.execute("SELECT pid FROM pg_stat_activity WHERE application_name LIKE "
                          "'outbox recorder %%' AND state = 'idle in transaction'").fetchall()
    worker.kill()
    wait_until(lambda: backend_gone(db, pid), "the killed recorder's backend to exit")
    assert hooked(db, schema) == [] and ledger(db, schema) == {}

    wait_until(lambda: lease_expired(db, schema, "k"), "the dead worker's lease to expire")
    stats = drain_hooked(dsn, schema)
    assert stats.rescued == 1
    _settled_once(dsn, db, schema, hooks_table)
    assert ("k", 2) in hooked(db, schema)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_claim_that_expired_while_it_performed_records_nothing_and_runs_no_hook(
    dsn: str, schema: str, db: Conn, hooks_table: Provider, workers: Workers, flavour: str,
) -> None:
    enqueue(db, schema, ["k"], {"pause": {"1": "after"}})
    stale = workers.start("run", lease=1.0, flavour=flavour, hooks=1)
    assert _paused(hooks_table, "after", stale.pid) == (1, 1)
    stale.signal(signal.SIGSTOP)
    wait_until(lambda: process_stopped(stale.pid), "the worker to stop")
    wait_until(lambda: lease_expired(db, schema, "k"), "the stalled worker's lease to expire")

    stats = drain_hooked(dsn, schema)  # rescues and completes at claim version 2
    assert (stats.rescued, stats.done) == (1, 2)
    assert hooked(db, schema) == [("followup-k", 1), ("k", 2)]

    hooks_table.release("k", attempt=1)
    stale.signal(signal.SIGCONT)
    stale.wait_log("was lost before its outcome was recorded")
    stale_stats = stale.stop()
    assert (stale_stats["done"], stale_stats["stale_completions"]) == (0, 1)
    _settled_once(dsn, db, schema, hooks_table)
    assert hooked(db, schema) == [("followup-k", 1), ("k", 2)]  # the stale hook never ran
    assert ledger(db, schema)["k"]["claim_version"] == 2


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_follow_ups_sharing_the_ordering_key_run_in_order_across_workers(
    dsn: str, schema: str, db: Conn, hooks_table: Provider, workers: Workers, flavour: str,
) -> None:
    keys = [f"o{n:02}" for n in range(12)]
    with outbox.transaction(db, schema=schema) as tx:  # one customer, one ordering key
        for key in keys:
            tx.enqueue(EFFECT, key=key, payload={"trace": True}, ordering_key="customer")
    started = [workers.start("run", lease=1.0, flavour=flavour, hooks=1) for _ in range(2)]
    wait_until(lambda: len(hooked(db, schema)) == 2 * len(keys),
               "every order and its follow-up done", timeout=60)
    for worker in started:
        worker.stop()
    # One at a time (each started after the one before had run its hook), in enqueue
    # order: the orders, then the follow-ups, which their parents' hooks enqueued later.
    points = [(key, point) for key, point, _, _, _ in hooks_table.checkpoints()]
    expected = [*keys, *(f"followup-{k}" for k in keys)]
    assert points == [(key, point) for key in expected for point in ("before", "after", "hook")]
