"""A hooked write lasting several leases keeps the leases it holds (real PostgreSQL).

Hundreds of flow jobs claimed together, each ``on_done`` hook doing a little slow SQL:
writing their outcomes takes several leases. The jobs whose outcomes wait their turn
meanwhile (still performing, or done and held in memory) have no row locked to keep the
rescuer away: only the heartbeat keeps their leases, and the recorder sends it between
the transactions of that write. So no claim expires, no job is rescued or performed twice.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import psycopg
import pytest

import outbox
from outbox import NewJob
from outbox.testing import jobs

from .shop import dispatch_once

EFFECT = "flow.slow_hooked"
JOBS = 300
LEASE = 2.0
HOOK_SQL = "SELECT pg_sleep(0.02)"  # 300 hooks: 6 s of writing, three leases
# Performs end over about a lease (300 jobs, 16 at a time): outcomes keep arriving while
# the recorder writes, and wait for the next write with nothing locked.
PERFORM_SECONDS = 0.1
CONCURRENCY = 16


class Counted(outbox.Effect):
    """Counts each key it is asked to perform, and takes a little while; its ``on_done``
    hooks (``record``, and ``record_async`` for AsyncDispatcher) wait in SQL and count
    their calls."""

    name = EFFECT

    def __init__(self) -> None:
        self.performed: Counter[str] = Counter()
        self.hooked: Counter[str] = Counter()
        self.lock = threading.Lock()

    def perform(self, job: outbox.Job) -> dict[str, Any]:
        with self.lock:
            self.performed[job.key] += 1
        time.sleep(PERFORM_SECONDS)
        return {"ok": True}

    def record(self, tx: outbox.HookTransaction, job: outbox.Job, result: Any) -> None:
        tx.execute(HOOK_SQL)
        self.hooked[job.key] += 1

    async def record_async(self, tx: outbox.AsyncHookTransaction, job: outbox.Job,
                           result: Any) -> None:
        await tx.execute(HOOK_SQL)
        self.hooked[job.key] += 1


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_hooked_outcomes_written_over_several_leases_lose_no_claim(
    dsn: str, schema: str, flavour: str,
) -> None:
    keys = [f"slow-{n}" for n in range(JOBS)]
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue_many([NewJob(EFFECT, key, {}) for key in keys])
    effect = Counted()
    # One claim takes every job (room for all of them held), so every lease starts then.
    options: dict[str, Any] = {"schema": schema, "lease": LEASE, "batch_size": JOBS,
                               "concurrency": CONCURRENCY, "prefetch": JOBS - CONCURRENCY}
    hook = effect.record if flavour == "sync" else effect.record_async
    stats = dispatch_once(flavour, dsn, [effect], on_done={EFFECT: hook}, **options)

    with psycopg.connect(dsn, autocommit=True) as conn:
        found = jobs(conn, schema)
    assert sorted(found) == sorted(keys)
    assert {(j["status"], j["claim_version"]) for j in found.values()} == {("done", 1)}
    assert effect.performed == Counter(keys)  # each key performed once
    assert effect.hooked == Counter(keys)  # each hook ran once
    assert stats.done == JOBS and stats.claimed == JOBS
    assert stats.rescued == stats.lost_claims == stats.stale_completions == 0

