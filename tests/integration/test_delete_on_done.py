"""Delete on done (``retention=0``) against real PostgreSQL: completion deletes the job
row and writes its ledger row in one fenced statement; a stale completion changes
nothing; the ledger alone keeps the key from being performed again. The recorder's
side, staged without threads, is in ``test_dispatcher_parts``."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import psycopg
import pytest

import outbox
from outbox import AsyncDispatcher, Dispatcher, NewJob
from outbox.testing import jobs, ledger

from .test_dispatcher_parts import ByPayload, enqueue


@pytest.mark.parametrize("retention", [0, 0.0, timedelta(0)])
def test_a_completed_job_leaves_only_its_ledger_row(
    dsn: str, schema: str, retention: float | timedelta
) -> None:
    enqueue(dsn, schema, *[NewJob("test.by_payload", f"k{i}", {}) for i in range(5)],
            NewJob("test.by_payload", "refused", {"raise": "permanent", "fail_attempts": [1]}))
    stats = Dispatcher(dsn, [ByPayload()], schema=schema,
                       retention=retention).run_until_idle(timeout=60)
    assert (stats.done, stats.failed, stats.stale_completions) == (5, 1, 0)
    # Only the failed job keeps its row: a person may need to look at it.
    assert {k: r["status"] for k, r in jobs(dsn, schema).items()} == {"refused": "failed"}
    rows = ledger(dsn, schema)
    assert set(rows) == {f"k{i}" for i in range(5)}
    assert all(r["result"] == {"attempt": 1} and r["claim_version"] == 1
               for r in rows.values())


def test_the_async_dispatcher_deletes_on_done_too(dsn: str, schema: str) -> None:
    enqueue(dsn, schema, *[NewJob("test.by_payload", f"a{i}", {}) for i in range(3)])
    stats = asyncio.run(AsyncDispatcher(dsn, [ByPayload()], schema=schema,
                                        retention=0).run_until_idle(timeout=60))
    assert stats.done == 3
    assert jobs(dsn, schema) == {}
    assert set(ledger(dsn, schema)) == {"a0", "a1", "a2"}


def test_the_default_retention_keeps_done_rows(dsn: str, schema: str) -> None:
    enqueue(dsn, schema, NewJob("test.by_payload", "kept", {}))
    assert Dispatcher(dsn, [ByPayload()], schema=schema).run_until_idle(timeout=60).done == 1
    assert jobs(dsn, schema)["kept"]["status"] == "done"
    assert set(ledger(dsn, schema)) == {"kept"}


def test_enqueueing_a_completed_key_again_is_a_no_op(dsn: str, schema: str) -> None:
    enqueue(dsn, schema, NewJob("test.by_payload", "once", {"n": 1}))
    assert Dispatcher(dsn, [ByPayload()], schema=schema,
                      retention=0).run_until_idle(timeout=60).done == 1
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        again = tx.enqueue("test.by_payload", key="once", payload={"n": 1})
        [many] = tx.enqueue_many([NewJob("test.by_payload", "once", {"n": 1})])
    assert (again.created, again.job_id) == (False, None)
    assert (many.created, many.job_id) == (False, None)
    assert jobs(dsn, schema) == {}
    # The ledger remembers what was performed: another payload under the key is refused.
    with pytest.raises(outbox.IdempotencyKeyConflict), psycopg.connect(dsn) as conn, \
            outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue("test.by_payload", key="once", payload={"n": 2})
