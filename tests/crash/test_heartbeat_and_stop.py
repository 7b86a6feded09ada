"""Leases kept alive by heartbeats, and a graceful stop that hands unstarted work back."""

from __future__ import annotations

import signal

import pytest
from psycopg import sql

from outbox.testing import jobs, ledger

from .provider import Conn, Provider
from .support import (
    Workers,
    dispatcher_backends,
    drain,
    enqueue,
    job,
    session,
    table,
    wait_until,
    waiting_on_lock,
)


def test_heartbeat_keeps_a_slow_effect_claimed_against_an_eager_rescuer(
    schema: str, db: Conn, provider: Provider, workers: Workers,
) -> None:
    enqueue(db, schema, ["slow"], {"sleep": 3.5, "trace": True})
    slow = workers.start("run", lease=1.0, concurrency=1)
    wait_until(lambda: provider.checkpoints("before"), "the slow effect to start")
    # A second dispatcher, rescuing every 0.1 s: it takes the job the moment a lease lapses.
    rescuer = workers.start("run", lease=1.0, rescue_interval=0.1, poll_interval=0.05)
    wait_until(lambda: job(db, schema, "slow")["status"] == "done"
               or job(db, schema, "slow")["attempts"] > 1, "the slow job to finish (or be lost)")
    rescuer_stats, slow_stats = rescuer.stop(), slow.stop()

    assert (rescuer_stats["rescued"], rescuer_stats["claimed"]) == (0, 0)
    assert (slow_stats["done"], slow_stats["lost_claims"], slow_stats["stale_completions"]) == (
        1, 0, 0)
    done = job(db, schema, "slow")
    assert (done["attempts"], done["claim_version"]) == (1, 1)
    [(_, _, _, _, pid_before), (_, _, _, _, pid_after)] = provider.checkpoints()
    assert pid_before == pid_after == slow.pid
    assert provider.performed() == {"slow": 1}
    assert ledger(db, schema)["slow"]["claim_version"] == 1
    took = db.execute(sql.SQL("SELECT max(at) - min(at) FROM {}").format(
        table(schema, "checkpoints"))).fetchone()
    assert took is not None and took[0].total_seconds() >= 3.0, "it outlived three leases"


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_sigterm_finishes_in_flight_work_and_hands_back_the_rest(
    dsn: str, schema: str, db: Conn, provider: Provider, workers: Workers,
    flavour: str,
) -> None:
    keys = [f"k{i}" for i in range(6)]
    enqueue(db, schema, keys, {"pause": "before"})
    worker = workers.start("run", lease=1.0, concurrency=2, prefetch=2, flavour=flavour)
    wait_until(lambda: len(provider.checkpoints("before")) == 2, "two effects in flight")
    in_flight = sorted(key for key, *_ in provider.checkpoints("before"))
    running = sorted(k for k, j in jobs(db, schema).items() if j["status"] == "running")
    waiting = sorted(set(running) - set(in_flight))
    never_claimed = sorted(set(keys) - set(running))
    assert waiting, "some claimed jobs are waiting for a free worker"
    assert never_claimed, "some jobs were left for later"

    worker.signal(signal.SIGTERM)
    worker.wait_log("stopping after in-flight work")
    assert worker.proc.poll() is None, "it waits for the effects in flight"
    assert {jobs(db, schema)[k]["status"] for k in in_flight} == {"running"}
    provider.release(*in_flight)
    wait_until(lambda: worker.proc.poll() is not None or len(provider.checkpoints()) > 2,
               "the worker to exit (or, wrongly, to start a waiting job)")
    assert len(provider.checkpoints()) == 2, "a job claimed before SIGTERM started after it"
    stats = worker.finish()  # and it exited 0
    assert (stats["done"], stats["released"], stats["claimed"]) == (
        len(in_flight), len(waiting), len(running))

    after = jobs(db, schema)
    assert {k: after[k]["status"] for k in keys if after[k]["status"] == "running"} == {}
    for key in in_flight:
        assert (after[key]["status"], after[key]["attempts"]) == ("done", 1)
    for key in waiting:  # claimed, never started: back to pending, the attempt refunded
        assert (after[key]["status"], after[key]["attempts"], after[key]["claim_version"]) == (
            "pending", 0, 1)
        assert (after[key]["lease_until"], after[key]["claimed_by"]) == (None, None)
    for key in never_claimed:  # nothing new was claimed after SIGTERM
        assert (after[key]["status"], after[key]["claim_version"]) == ("pending", 0)
    assert provider.performed() == dict.fromkeys(in_flight, 1)

    provider.release(*waiting, *never_claimed)
    assert drain(dsn, schema).done == len(waiting) + len(never_claimed)
    assert provider.performed() == dict.fromkeys(keys, 1)


def _claimer_blocked(db: Conn, schema: str) -> bool:
    return any(waiting_on_lock(db, pid) for pid in dispatcher_backends(db, schema, "claimer"))


def test_sigterm_while_the_claimer_is_busy_starts_no_waiting_job(
    dsn: str, schema: str, db: Conn, provider: Provider, workers: Workers,
) -> None:
    """SIGTERM lands while the claimer is inside a statement (here blocked on a table
    lock; under load, a slow claim). A job claimed but not started must not start after
    it, even though the claimer has not yet got round to draining."""
    enqueue(db, schema, ["a", "b"], {"pause": "before"})
    worker = workers.start("run", lease=5.0, concurrency=1, prefetch=1, rescue_interval=0.1,
                           poll_interval=0.05)
    wait_until(lambda: len(provider.checkpoints()) == 1, "one effect in flight")
    [(in_flight, *_)] = provider.checkpoints()
    [waiting] = {"a", "b"} - {in_flight}
    assert jobs(db, schema)[waiting]["status"] == "running", "claimed, waiting for a worker"

    with session(dsn) as locker:
        locker.execute(sql.SQL("LOCK TABLE {} IN SHARE MODE").format(table(schema, "jobs")))
        wait_until(lambda: _claimer_blocked(db, schema), "the claimer to block in a statement")
        worker.signal(signal.SIGTERM)
        worker.wait_log("stopping")
        provider.release(in_flight)
        wait_until(lambda: provider.performed() == {in_flight: 1}, "the in-flight effect to act")
    wait_until(lambda: worker.proc.poll() is not None or len(provider.checkpoints()) > 1,
               "the worker to exit (or, wrongly, to start the waiting job)")
    assert [key for key, *_ in provider.checkpoints()] == [in_flight], (
        f"{waiting} was started after SIGTERM had been handled")
    stats = worker.finish()
    assert (stats["done"], stats["released"]) == (1, 1)
    after = jobs(db, schema)[waiting]
    assert (after["status"], after["attempts"]) == ("pending", 0)


@pytest.mark.parametrize("flavour", ["sync", "async", "async-threads"])
def test_a_perform_that_never_returns_holds_the_stop_no_longer_than_stop_timeout(
    schema: str, db: Conn, provider: Provider, workers: Workers, flavour: str,
) -> None:
    enqueue(db, schema, ["stuck"], {"hang": 1})
    enqueue(db, schema, ["queued"])
    # One worker, one job waiting for it: "queued" is claimed but can never start.
    hung = workers.start("run", lease=2.0, concurrency=1, prefetch=1, stop_timeout=1.0,
                         flavour=flavour)
    wait_until(lambda: provider.checkpoints("hang"), "the effect to act, then hang")
    wait_until(lambda: job(db, schema, "queued")["status"] == "running",
               "the second job to be claimed, waiting for the worker")

    hung.signal(signal.SIGTERM)
    stats = hung.finish(timeout=30)  # exits 0, its perform still hanging
    log = hung.log()
    assert "stop_timeout (1s) passed: job" in log and "'stuck'" in log, log
    assert "still performing" in log
    assert stats["done"] == 0 and stats["released"] == 1
    assert "'queued'" not in log, "a job that never started is handed back, not left"
    back = job(db, schema, "queued")
    assert (back["status"], back["attempts"]) == ("pending", 0), "handed back, refunded"
    left = job(db, schema, "stuck")
    assert (left["status"], left["attempts"], left["claim_version"]) == ("running", 1, 1), (
        "left to its lease: neither done nor handed back as unstarted")
    assert "stuck" not in ledger(db, schema)

    # The next dispatcher takes it back once the lease expires and performs it again.
    successor = workers.start("run", lease=2.0, rescue_interval=0.1, poll_interval=0.05,
                              flavour=flavour)
    wait_until(lambda: {job(db, schema, k)["status"] for k in ("stuck", "queued")} == {"done"},
               "the job to be redone, and the one handed back to be done")
    successor.stop()
    done = job(db, schema, "stuck")
    assert (done["attempts"], done["claim_version"]) == (2, 2)
    assert ledger(db, schema)["stuck"]["claim_version"] == 2
    assert provider.performed() == {"stuck": 2, "queued": 1}, (
        "at least once to the adapter: twice here for the one left to its lease")
    assert set(provider.acted()) == {"stuck", "queued"}, "the provider acted once a key"
