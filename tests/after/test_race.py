"""The race of fan-in, made to happen for real: a child enqueued in a business
transaction that is still open while its parent's done transaction commits. Under READ
COMMITTED neither sees the other (the child's enqueue saw the parent pending, the
settlement did not see the uncommitted edge), so only the dispatchers' sweep can release
the child, and it must."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import psycopg

import outbox

from .support import job_row

PARENT, CHILD = "parent.work", "child.work"


class Recording(outbox.Effect):
    def __init__(self, name: str) -> None:
        self.name = name  # type: ignore[misc]
        self.performed: list[tuple[str, dict[str, Any]]] = []
        self.done = threading.Event()

    def perform(self, job: outbox.Job) -> dict[str, Any]:
        self.performed.append((job.key, dict(job.after_results)))
        self.done.set()
        return {"by": job.key}


def _race(dsn: str, schema: str, parent: Recording) -> None:
    """Parent committed and pending; the child enqueued in a transaction held open while
    a dispatcher completes the parent; then that transaction commits."""
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue(PARENT, key="p", payload={})
    with psycopg.connect(dsn) as business, outbox.transaction(business, schema=schema) as tx:
        tx.enqueue(CHILD, key="c", payload={}, after=["p"])
        # still open: the parent is done and committed meanwhile
        stats = outbox.Dispatcher(dsn, effects=[parent], schema=schema,
                                  lease=10.0).run_until_idle(timeout=60)
        assert stats.done == 1
    # the business transaction committed when its block ended


def test_a_child_committed_after_its_parent_settled_is_released_by_the_sweep(
        dsn: str, schema: str) -> None:
    parent, child = Recording(PARENT), Recording(CHILD)
    _race(dsn, schema, parent)

    # The race happened: the parent is done, yet the child still counts it as to come.
    assert job_row(dsn, schema, "p")["status"] == "done"
    waiting = job_row(dsn, schema, "c")
    assert (waiting["status"], waiting["after_waiting"]) == ("pending", 1)

    stats = outbox.Dispatcher(dsn, effects=[child], schema=schema,
                              lease=10.0).run_until_idle(timeout=60)

    assert stats.done == 1
    assert child.performed == [("c", {"p": {"by": "p"}})]
    assert job_row(dsn, schema, "c")["status"] == "done"


def test_a_running_dispatcher_sweeps_the_race_too(dsn: str, schema: str) -> None:
    parent, child = Recording(PARENT), Recording(CHILD)
    dispatcher = outbox.Dispatcher(dsn, effects=[child], schema=schema, lease=10.0,
                                   poll_interval=0.2)
    runner = threading.Thread(target=dispatcher.run, daemon=True)
    runner.start()
    try:
        _race(dsn, schema, parent)
        assert child.done.wait(60), "the child was left waiting after its parent was done"
    finally:
        dispatcher.stop()
        runner.join(60)
    assert child.performed == [("c", {"p": {"by": "p"}})]
    assert job_row(dsn, schema, "c")["status"] == "done"  # recorded before run() returned


def test_async_enqueue_and_async_dispatcher_wait_alike(dsn: str, schema: str) -> None:
    parent, child = Recording(PARENT), Recording(CHILD)

    async def scenario() -> outbox.DispatchStats:
        async with await psycopg.AsyncConnection.connect(dsn) as conn, \
                outbox.transaction(conn, schema=schema) as tx:
            await tx.enqueue(PARENT, key="p", payload={})
            await tx.enqueue(CHILD, key="c", payload={}, after=["p"])
        dispatcher = outbox.AsyncDispatcher(dsn, effects=[parent, child], schema=schema,
                                            lease=10.0)
        return await dispatcher.run_until_idle(timeout=60)

    stats = asyncio.run(scenario())
    assert stats.done == 2
    assert child.performed == [("c", {"p": {"by": "p"}})]


def test_the_sweep_walks_every_edge_of_a_child_with_more_parents_than_a_batch(
        dsn: str, schema: str) -> None:
    """Parents settled behind the settlement's back (as the race leaves them), more of
    them than the sweep looks at in one call (1,000): the walk goes through one child's
    edges a batch at a time, never past them."""
    parents = [f"p{i:04d}" for i in range(1200)]
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue_many([outbox.NewJob(PARENT, key=key, payload={}) for key in parents])
        tx.enqueue(CHILD, key="c", payload={}, after=parents)
    with psycopg.connect(dsn, autocommit=True) as conn:  # done, no edge resolved
        conn.execute(f"""UPDATE "{schema}".jobs SET status = 'done' WHERE key LIKE 'p%'""")
    child = Recording(CHILD)

    stats = outbox.Dispatcher(dsn, effects=[child], schema=schema,
                              lease=10.0).run_until_idle(timeout=60)

    assert stats.done == 1 and [key for key, _ in child.performed] == ["c"]
