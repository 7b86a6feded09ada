"""The failure windows (crashes between two steps of a job's life), one by one, with real
processes and kill -9.

Each test stops a worker at a chosen point: the effect records a checkpoint row and blocks,
the test waits for that row (no blind sleeps), then kills, stops or blocks the worker. Lease
expiry is the one inherent wait; leases are 1 s and the tests poll for the expiry.
"""

from __future__ import annotations

import signal
import time

import psycopg
import pytest
from psycopg import sql

import outbox
from outbox.sql import queries
from outbox.testing import jobs, ledger

from .provider import EFFECT, Conn, Provider
from .support import (
    Workers,
    backend_gone,
    dispatcher_backends,
    drain,
    enqueue,
    job,
    lease_expired,
    poll_for,
    process_stopped,
    session,
    table,
    wait_until,
    waiting_on_lock,
)


class Abort(Exception):
    """The business code failing inside its transaction."""


def _orders(db: Conn, schema: str) -> int:
    row = db.execute(sql.SQL("SELECT count(*) FROM {}").format(table(schema, "orders"))).fetchone()
    assert row is not None
    return int(row[0])


def _order_and_email(db: Conn, schema: str, order: int) -> outbox.EnqueueResult:
    with outbox.transaction(db, schema=schema) as tx:
        db.execute(sql.SQL("INSERT INTO {} (id) VALUES (%s)").format(table(schema, "orders")),
                   (order,))
        return tx.enqueue(EFFECT, key=f"email-order-{order}", payload={})


def test_rolled_back_business_transaction_leaves_no_job_and_nothing_performed(
    dsn: str, schema: str, db: Conn, provider: Provider,
) -> None:
    db.execute(sql.SQL("CREATE TABLE {} (id int PRIMARY KEY)").format(table(schema, "orders")))
    with pytest.raises(Abort), outbox.transaction(db, schema=schema) as tx:
        db.execute(sql.SQL("INSERT INTO {} VALUES (102)").format(table(schema, "orders")))
        assert tx.enqueue(EFFECT, key="email-order-102", payload={}).created
        raise Abort
    # Inside the caller's transaction the block is a savepoint: the job goes when it does.
    with pytest.raises(Abort), db.transaction():
        _order_and_email(db, schema, 103)
        raise Abort
    assert (_orders(db, schema), jobs(db, schema)) == (0, {})

    stats = drain(dsn, schema)
    assert stats.claimed == 0
    assert (provider.performed(), ledger(db, schema)) == ({}, {})

    # The same intent, committed this time, is performed once: the rollback left no trace.
    assert _order_and_email(db, schema, 102).created
    assert drain(dsn, schema).done == 1
    assert provider.performed() == {"email-order-102": 1}


def test_business_process_killed_before_commit_leaves_no_job(
    dsn: str, schema: str, db: Conn, provider: Provider, workers: Workers,
) -> None:
    db.execute(sql.SQL("CREATE TABLE {} (id int PRIMARY KEY)").format(table(schema, "orders")))
    business = workers.start("hold-enqueue", order=104)
    held = business.read_json_line()
    assert held["job_id"] is not None  # the job row exists, in the uncommitted transaction
    assert jobs(db, schema) == {}

    business.kill()
    wait_until(lambda: backend_gone(db, held["backend_pid"]), "the killed process's backend")
    assert (_orders(db, schema), jobs(db, schema)) == (0, {})
    assert drain(dsn, schema).claimed == 0
    assert provider.performed() == {}


@pytest.mark.parametrize("death", ["kill -9 the worker", "pg_terminate_backend"])
def test_worker_dead_before_its_claim_commits_is_reclaimed_at_once(
    dsn: str, schema: str, db: Conn, provider: Provider, workers: Workers, death: str,
) -> None:
    enqueue(db, schema, ["k"])
    holder = workers.start("hold-claim", lease=30.0)
    held = holder.read_json_line()
    claimed = job(db, schema, "k")
    assert held["ids"] == [claimed["id"]]
    # Not committed: others still see it pending, but its row lock keeps them off it.
    assert (claimed["status"], claimed["attempts"], claimed["claim_version"]) == ("pending", 0, 0)
    others = db.execute(queries(schema).claim, {
        "effects": [EFFECT], "limit": 10, "lease": 30.0, "worker": "other", "after": "{}",
    }).fetchall()
    assert others == []

    if death == "kill -9 the worker":
        holder.kill()
    else:
        db.execute("SELECT pg_terminate_backend(%s)", (held["backend_pid"],))
    wait_until(lambda: backend_gone(db, held["backend_pid"]), "the claim's backend to exit")

    started = time.monotonic()
    stats = drain(dsn, schema, lease=30.0)
    elapsed = time.monotonic() - started
    assert (stats.claimed, stats.rescued, stats.done) == (1, 0, 1)
    assert elapsed < 10.0, "re-claimed at once, not after the 30 s lease"
    done = job(db, schema, "k")
    # The dead claim rolled back entirely: it did not even count as an attempt.
    assert (done["status"], done["attempts"], done["claim_version"]) == ("done", 1, 1)
    assert provider.performed() == {"k": 1}


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_dispatcher_killed_inside_its_claim_statement_claims_nothing(
    dsn: str, schema: str, db: Conn, provider: Provider, workers: Workers, flavour: str,
) -> None:
    """The window the dispatcher's client check closes: killed while its own claim
    statement runs (here, waiting for a lock), the statement must not run on once the
    lock is granted and commit a claim for a dead worker (jobs running under a lease
    nobody renews, an attempt spent for nothing)."""
    keys = ["a", "b", "c"]
    enqueue(db, schema, keys)
    with session(dsn) as locker:
        locker.execute(sql.SQL("LOCK TABLE {} IN SHARE MODE").format(table(schema, "jobs")))
        worker = workers.start("run", lease=30.0, flavour=flavour)
        claimer = poll_for(lambda: next((pid for pid in dispatcher_backends(db, schema, "claimer")
                                         if waiting_on_lock(db, pid)), None),
                           "the dispatcher's claim waiting for the lock")
        worker.kill()
        # Still inside the statement, the lock still refused: only the server's check
        # that its client is gone (client_connection_check_interval) ends it now.
        wait_until(lambda: backend_gone(db, claimer), "the dead dispatcher's claim to end",
                   timeout=15.0)
    assert {k: (j["status"], j["attempts"], j["claim_version"])
            for k, j in jobs(db, schema).items()} == dict.fromkeys(keys, ("pending", 0, 0))
    assert drain(dsn, schema, lease=30.0).done == len(keys)
    assert provider.performed() == dict.fromkeys(keys, 1)


def _paused(provider: Provider, point: str, worker_pid: int) -> tuple[int, int]:
    """Wait until the effect is paused at ``point`` in ``worker_pid``; (attempt, version)."""
    wait_until(lambda: provider.checkpoints(point), f"the effect to pause {point} the provider")
    [(_, _, attempt, version, pid)] = provider.checkpoints(point)
    assert pid == worker_pid
    return attempt, version


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_worker_killed_after_claim_before_provider_call_is_rescued_and_performed_once(
    dsn: str, schema: str, db: Conn, provider: Provider, workers: Workers,
    flavour: str,
) -> None:
    enqueue(db, schema, ["k"], {"pause": "before"})
    worker = workers.start("run", lease=1.0, flavour=flavour)
    assert _paused(provider, "before", worker.pid) == (1, 1)
    running = job(db, schema, "k")
    assert (running["status"], running["claimed_by"] is not None) == ("running", True)
    assert provider.performed() == {}

    worker.kill()
    wait_until(lambda: lease_expired(db, schema, "k"), "the dead worker's lease to expire")
    stats = drain(dsn, schema)
    assert (stats.rescued, stats.claimed, stats.done) == (1, 1, 1)

    done = job(db, schema, "k")
    assert (done["status"], done["attempts"], done["claim_version"]) == ("done", 2, 2)
    assert provider.performed() == {"k": 1}
    assert provider.acted() == {"k": 2}
    [row] = ledger(db, schema).values()
    assert (row["key"], row["job_id"], row["claim_version"]) == ("k", done["id"], 2)


def test_worker_killed_after_provider_acted_before_done_is_deduplicated(
    dsn: str, schema: str, db: Conn, provider: Provider, workers: Workers,
) -> None:
    enqueue(db, schema, ["k"], {"pause": "after"})
    worker = workers.start("run", lease=1.0)
    assert _paused(provider, "after", worker.pid) == (1, 1)
    assert (provider.performed(), provider.acted(), ledger(db, schema)) == ({"k": 1}, {"k": 1}, {})

    worker.kill()
    wait_until(lambda: lease_expired(db, schema, "k"), "the dead worker's lease to expire")
    stats = drain(dsn, schema)
    assert (stats.rescued, stats.done) == (1, 1)

    done = job(db, schema, "k")
    assert (done["status"], done["attempts"], done["claim_version"]) == ("done", 2, 2)
    # Delivered twice with the same key; the provider acted once, on the first claim.
    assert provider.performed() == {"k": 2}
    assert provider.acted() == {"k": 1}
    [row] = ledger(db, schema).values()
    assert (row["key"], row["claim_version"], row["result"]["claim_version"]) == ("k", 2, 2)


def _recorder_waiting(db: Conn, schema: str) -> int | None:
    """The pid of the dispatcher recorder serving ``schema`` if it is blocked on a lock."""
    recorders = [pid for pid in dispatcher_backends(db, schema, "recorder")
                 if waiting_on_lock(db, pid)]
    return recorders[0] if recorders else None


@pytest.mark.parametrize("ending", ["backend terminated", "statement let through"])
def test_worker_killed_during_its_done_transaction(
    dsn: str, schema: str, db: Conn, provider: Provider, workers: Workers, ending: str,
) -> None:
    enqueue(db, schema, ["k"])
    with session(dsn) as blocker:
        # An uncommitted ledger row for the same key. The worker's complete statement
        # updates the job row to done, then waits on this key: it is stuck mid-transaction.
        blocker.execute(
            sql.SQL("INSERT INTO {} (key, effect, job_id, claim_version, fingerprint)"
                    " VALUES ('k', 'blocker', 0, 0, 'blocker')").format(
                        table(schema, "effect_results")))
        worker = workers.start("run", lease=1.0)
        recorder_pid = poll_for(lambda: _recorder_waiting(db, schema),
                                "the worker's done statement to block on the ledger key")
        assert provider.performed() == {"k": 1}
        with pytest.raises(psycopg.errors.LockNotAvailable):  # its UPDATE already ran
            db.execute(sql.SQL("SELECT 1 FROM {} WHERE key = 'k' FOR UPDATE NOWAIT").format(
                table(schema, "jobs")))
        assert job(db, schema, "k")["status"] == "running"

        worker.kill()
        if ending == "backend terminated":
            db.execute("SELECT pg_terminate_backend(%s)", (recorder_pid,))
            wait_until(lambda: backend_gone(db, recorder_pid), "the recorder's backend to exit")
        blocker.rollback()

    if ending == "backend terminated":
        # The done transaction rolled back with its backend: rescued and redone, once.
        wait_until(lambda: lease_expired(db, schema, "k"), "the dead worker's lease to expire")
        stats = drain(dsn, schema)
        assert (stats.rescued, stats.done) == (1, 1)
        expected = ("done", 2, 2)
        assert provider.performed() == {"k": 2}
    else:
        # The dead worker's statement was already in the server: it commits without it.
        wait_until(lambda: job(db, schema, "k")["status"] == "done", "the in-flight done")
        wait_until(lambda: backend_gone(db, recorder_pid), "the recorder's backend to exit")
        stats = drain(dsn, schema)
        assert (stats.claimed, stats.rescued) == (0, 0)
        expected = ("done", 1, 1)
        assert provider.performed() == {"k": 1}

    done = job(db, schema, "k")
    assert (done["status"], done["attempts"], done["claim_version"]) == expected
    assert provider.acted() == {"k": 1}
    [row] = ledger(db, schema).values()
    assert (row["effect"], row["job_id"], row["claim_version"]) == (EFFECT, done["id"], expected[2])


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_stalled_worker_wakes_to_find_its_claim_fenced(
    schema: str, db: Conn, provider: Provider, workers: Workers,
    flavour: str,
) -> None:
    # Attempt 1 pauses before the provider call; attempt 2 pauses after it, so the
    # rescuer's claim is still in flight when the stale worker wakes up.
    enqueue(db, schema, ["k"], {"pause": {"1": "before", "2": "after"}})
    stale = workers.start("run", lease=1.0, flavour=flavour)
    assert _paused(provider, "before", stale.pid) == (1, 1)

    stale.signal(signal.SIGSTOP)
    wait_until(lambda: process_stopped(stale.pid), "the worker to stop")
    wait_until(lambda: lease_expired(db, schema, "k"), "the stalled worker's lease to expire")
    rescuer = workers.start("run", lease=1.0)
    assert _paused(provider, "after", rescuer.pid) == (2, 2)
    assert (provider.performed(), provider.acted()) == ({"k": 1}, {"k": 2})

    # Wake the stale worker: its effect goes on to the provider (deduplicated), and its
    # done, fenced on claim version 1, changes nothing while claim 2 is in flight.
    provider.release("k", attempt=1)
    stale.signal(signal.SIGCONT)
    wait_until(lambda: provider.performed() == {"k": 2}, "the woken worker to call the provider")
    stale_stats = stale.stop()  # SIGTERM: it records its in-flight outcome, then exits
    assert (stale_stats["done"], stale_stats["stale_completions"]) == (0, 1)
    assert "lost" in stale.log()
    held = job(db, schema, "k")
    assert (held["status"], held["attempts"], held["claim_version"]) == ("running", 2, 2)
    assert ledger(db, schema) == {}

    provider.release("k", attempt=2)
    wait_until(lambda: job(db, schema, "k")["status"] == "done", "the rescuer's done")
    assert rescuer.stop()["done"] == 1
    done = job(db, schema, "k")
    assert (done["attempts"], done["claim_version"]) == (2, 2)
    [row] = ledger(db, schema).values()
    assert (row["claim_version"], row["result"]["claim_version"]) == (2, 2)
    assert (provider.performed(), provider.acted()) == ({"k": 2}, {"k": 2})


def test_a_worker_id_reused_by_a_restart_fences_like_any_other(
    dsn: str, schema: str, db: Conn, provider: Provider, workers: Workers,
) -> None:
    # A pod restarted under the same name: the old process (stalled past its lease, then
    # woken) and the new one both call themselves "pod-1". Nothing decides on the name:
    # the old claim is not taken for the new one's (its done is fenced out), and the new
    # one's live claim is not taken for the dead one's (no rescue while it heartbeats).
    enqueue(db, schema, ["k"], {"pause": {"1": "before", "2": "after"}})
    old = workers.start("run", lease=1.0, worker_id="pod-1")
    assert _paused(provider, "before", old.pid) == (1, 1)
    old.signal(signal.SIGSTOP)
    wait_until(lambda: process_stopped(old.pid), "the old process to stop")
    wait_until(lambda: lease_expired(db, schema, "k"), "the old process's lease to expire")

    new = workers.start("run", lease=1.0, worker_id="pod-1")
    assert _paused(provider, "after", new.pid) == (2, 2)
    held = job(db, schema, "k")
    assert (held["status"], held["claimed_by"], held["claim_version"]) == ("running", "pod-1", 2)
    # The new claim outlives several leases while it heartbeats: never rescued.
    deadline = time.monotonic() + 3.5
    while time.monotonic() < deadline:
        assert job(db, schema, "k")["claim_version"] == 2
        time.sleep(0.1)

    provider.release("k", attempt=1)
    old.signal(signal.SIGCONT)
    wait_until(lambda: provider.performed() == {"k": 2}, "the woken old process's call")
    old_stats = old.stop()
    assert (old_stats["done"], old_stats["stale_completions"]) == (0, 1)
    assert job(db, schema, "k")["claim_version"] == 2  # its same name took nothing over

    provider.release("k", attempt=2)
    wait_until(lambda: job(db, schema, "k")["status"] == "done", "the new process's done")
    assert new.stop()["done"] == 1
    [row] = ledger(db, schema).values()
    assert (row["claim_version"], row["result"]["claim_version"]) == (2, 2)
    assert provider.acted() == {"k": 2}


def test_a_job_that_kills_its_worker_every_time_ends_in_reconcile(
    schema: str, db: Conn, provider: Provider, workers: Workers,
) -> None:
    with outbox.transaction(db, schema=schema) as tx:
        tx.enqueue(EFFECT, key="poison", payload={"crash": True}, max_attempts=2)
    enqueue(db, schema, [f"ok-{i}" for i in range(5)])
    deaths = 0
    for _ in range(4):  # a supervisor restarting the worker each time it dies
        worker = workers.start("run", lease=1.0)
        wait_until(lambda: worker.proc.poll() is not None  # noqa: B023 - waited on here
                   or job(db, schema, "poison")["status"] == "reconcile", "a death or the end")
        if worker.proc.poll() is None:
            wait_until(lambda: all(j["status"] == "done" for k, j in jobs(db, schema).items()
                                   if k != "poison"), "the healthy jobs, done despite the poison")
            worker.stop()
            break
        assert worker.proc.returncode == -signal.SIGKILL
        deaths += 1
    assert deaths == 2, "one death per attempt, and no more once attempts ran out"
    poison = job(db, schema, "poison")
    # Each death is an unknown outcome (the worker may have acted before it died): with
    # its attempts used up the job goes to reconcile, as an UnknownOutcome raised would.
    assert (poison["status"], poison["attempts"], poison["claim_version"]) == (
        "reconcile", 2, 2)
    assert poison["last_error"].startswith("UnknownOutcome: lease expired on attempt 2 of 2")
    assert poison["last_error"].endswith("(attempts exhausted)")
    performed = provider.performed()
    assert sorted(performed) == [f"ok-{i}" for i in range(5)]
    assert all(n <= job(db, schema, k)["attempts"] for k, n in performed.items())


def test_no_job_stays_running_past_its_lease_plus_a_rescue_interval(
    schema: str, db: Conn, provider: Provider, workers: Workers,
) -> None:
    keys = [f"k{i:02d}" for i in range(12)]
    enqueue(db, schema, keys, {"pause": "before"})
    worker = workers.start("run", lease=1.0, concurrency=4, prefetch=8)
    wait_until(lambda: len(provider.checkpoints()) == 4, "four effects in flight")
    claims = {j["claimed_by"] for j in jobs(db, schema).values()}
    assert len(claims) == 1 and None not in claims, "in flight and prefetched, all claimed"
    [dead] = claims
    worker.kill()
    rescuer = workers.start("run", lease=1.0)  # rescue_interval defaults to min(lease, 5 s)
    # Bound: the lease (1 s, heartbeated until the kill) plus one rescue interval (1 s),
    # plus the rescuer's start-up and slack for a loaded machine.
    wait_until(lambda: all(j["claimed_by"] != dead for j in jobs(db, schema).values()),
               "every claim of the dead worker to be taken back", timeout=6.0)
    wait_until(lambda: {j["status"] for j in jobs(db, schema).values()} == {"done"}, "all done")
    stats = rescuer.stop()
    assert stats["rescued"] == len(keys)
    assert provider.performed() == dict.fromkeys(keys, 1), "attempt 2 does not pause"
