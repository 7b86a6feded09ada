"""``DispatchStats`` is counted from the observer events: an observer that sums the
batch events hears exactly the counters a run returns, whatever happened."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any

import psycopg
import pytest
from psycopg import sql

import outbox
from outbox import Effect, Job, NewJob
from outbox.observe import AttemptOutcome, DispatchObserver, PurgedTable, ReconnectingPart
from outbox.testing import jobs

from .helpers import wait_until


class Summing(DispatchObserver):
    """Adds up every batch event, as a user's own counters would."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.claims = 0
        self.jobs_claimed = 0
        self.outcomes: Counter[AttemptOutcome] = Counter()
        self.tables: Counter[PurgedTable] = Counter()
        self.reconnects: Counter[ReconnectingPart] = Counter()
        self.lost_claims = 0
        self.rescues = 0
        self.fenced = 0
        self.lost = threading.Event()

    def claimed(self, duration: float, waits: Sequence[tuple[str, float]]) -> None:
        with self.lock:
            self.claims += 1
            self.jobs_claimed += len(list(waits))

    def recorded(self, outcome: AttemptOutcome, count: int) -> None:
        assert count > 0
        with self.lock:
            self.outcomes[outcome] += count

    def purged(self, table: PurgedTable, count: int) -> None:
        assert count > 0
        with self.lock:
            self.tables[table] += count

    def reconnected(self, part: ReconnectingPart) -> None:
        with self.lock:
            self.reconnects[part] += 1

    def claims_lost(self, count: int) -> None:
        with self.lock:
            self.lost_claims += count
        self.lost.set()

    def rescued(self, count: int) -> None:
        with self.lock:
            self.rescues += count

    def fence_rejected(self, effect: str) -> None:
        with self.lock:
            self.fenced += 1

    def as_stats(self) -> dict[str, int]:
        """What ``DispatchStats`` should hold, from the events alone."""
        r = self.outcomes
        return {"claimed": self.jobs_claimed, "claim_queries": self.claims, "done": r["done"],
                "retried": r["retry"], "failed": r["failed"], "reconcile": r["reconcile"],
                "released": r["released"], "stale_completions": r["lost"],
                "lost_claims": self.lost_claims, "rescued": self.rescues,
                "reconnects": sum(self.reconnects.values()),
                "purged": sum(self.tables.values())}


def _counted(stats: outbox.DispatchStats) -> dict[str, int]:
    return {k: v for k, v in stats.as_dict().items() if isinstance(v, int)}


class ByPayload(Effect):
    name = "stats.by_payload"

    def perform(self, job: Job) -> dict[str, int]:
        if "raise" in job.payload:
            raise {"retry": outbox.Retry("busy", after=3600),
                   "permanent": outbox.Permanent("no"),
                   "unknown": outbox.UnknownOutcome("timeout")}[job.payload["raise"]]
        return {"attempt": job.attempt}


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_the_counters_are_the_sum_of_the_events(dsn: str, schema: str, flavour: str) -> None:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue_many([NewJob(ByPayload.name, f"ok-{i}", {}) for i in range(30)] + [
            NewJob(ByPayload.name, "retried", {"raise": "retry"}),
            NewJob(ByPayload.name, "refused", {"raise": "permanent"}),
            NewJob(ByPayload.name, "unknown", {"raise": "unknown"}, max_attempts=1)])
        assert tx.receive("billing", "m-old") and tx.receive("billing", "m-new")
    with psycopg.connect(dsn, autocommit=True) as conn:  # a done job and a message, old
        ident = sql.Identifier(schema)
        conn.execute(sql.SQL("INSERT INTO {}.inbox (consumer, message_id, received_at) "
                             "VALUES ('billing', 'm-older', now() - interval '30 days')"
                             ).format(ident))
        conn.execute(sql.SQL("UPDATE {}.inbox SET received_at = now() - interval '8 days' "
                             "WHERE message_id = 'm-old'").format(ident))
    summing = Summing()
    options: dict[str, Any] = {"schema": schema, "observer": summing, "batch_size": 7}
    if flavour == "sync":
        stats = outbox.Dispatcher(dsn, [ByPayload()], **options).run_until_idle(timeout=30)
    else:
        stats = asyncio.run(outbox.AsyncDispatcher(dsn, [ByPayload()], **options)
                            .run_until_idle(30))
    assert _counted(stats) == summing.as_stats()
    assert (stats.done, stats.retried, stats.failed, stats.reconcile) == (30, 1, 1, 1)
    assert summing.tables == {"inbox": 2} and stats.purged == 2
    assert stats.claim_queries >= 5  # batches of 7: counted per claim, not per job


class Gate(Effect):
    """Blocks each perform until released."""

    name = "stats.gate"

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()

    def perform(self, job: Job) -> None:
        self.started.set()
        assert self.release.wait(30)


def _serve(dispatcher: outbox.Dispatcher) -> tuple[threading.Thread, list[outbox.DispatchStats]]:
    result: list[outbox.DispatchStats] = []
    thread = threading.Thread(target=lambda: result.append(dispatcher.run()))
    thread.start()
    return thread, result


def test_a_heartbeat_lost_claim_and_a_stale_completion_are_told_apart(
    dsn: str, schema: str
) -> None:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue(Gate.name, key="k", payload={})
    gate, summing = Gate(), Summing()
    dispatcher = outbox.Dispatcher(dsn, [gate], schema=schema, lease=1, observer=summing,
                                   rescue_interval=3600)  # no rescue of its own
    thread, result = _serve(dispatcher)
    try:
        assert gate.started.wait(30)
        with psycopg.connect(dsn, autocommit=True) as other:  # taken over elsewhere
            other.execute(sql.SQL("UPDATE {}.jobs SET claim_version = claim_version + 1, "
                                  "claimed_by = 'other' WHERE key = 'k'").format(
                                      sql.Identifier(schema)))
        assert summing.lost.wait(30), "the heartbeat never found the claim gone"
    finally:
        gate.release.set()
        wait_until(lambda: summing.outcomes["lost"] == 1, what="the stale completion")
        dispatcher.stop()
        thread.join(30)
    stats = result[0]
    assert (stats.lost_claims, stats.stale_completions, stats.done) == (1, 1, 0)
    assert summing.fenced == 2  # the heartbeat's and the completion's fenced writes
    assert _counted(stats) == summing.as_stats()
    assert jobs(dsn, schema)["k"]["claimed_by"] == "other"


def test_lost_connections_are_reported_by_part(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue(Gate.name, key="k", payload={})
    gate, summing = Gate(), Summing()
    dispatcher = outbox.Dispatcher(dsn, [gate], schema=schema, lease=1, observer=summing,
                                   poll_interval=0.05)
    thread, result = _serve(dispatcher)
    try:
        assert gate.started.wait(30)
        names = [f"outbox {part} {dispatcher.worker_id}"[:63] for part in ("claimer", "recorder")]
        with psycopg.connect(dsn, autocommit=True) as other:
            # The recorder connects on its first heartbeat: wait for both sessions.
            wait_until(lambda: other.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = ANY(%s)",
                [names]).fetchone() == (2,), what="the claimer's and recorder's sessions")
            other.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                          "WHERE application_name = ANY(%s)", [names])
        wait_until(lambda: summing.reconnects.keys() == {"claimer", "recorder"},
                   what="both parts to report their lost connection")
    finally:
        gate.release.set()
        dispatcher.stop()
        thread.join(30)
    stats = result[0]
    assert stats.done == 1 and stats.reconnects == sum(summing.reconnects.values())
    assert _counted(stats) == summing.as_stats()
