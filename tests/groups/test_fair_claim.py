"""Groups and priorities against real PostgreSQL: claims go round the busy groups of an
effect, a priority overtakes a backlog of its group, and ageing keeps lower ones going."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

import outbox
import outbox.sql
from outbox import Dispatcher, Effect, Job, NewJob
from outbox.errors import InvalidArgument
from outbox.testing import jobs


class Ordered(Effect):
    """Remembers the order in which keys were performed."""

    name = "test.ordered"

    def __init__(self) -> None:
        self.order: list[str] = []
        self.lock = threading.Lock()

    def perform(self, job: Job) -> None:
        with self.lock:
            self.order.append(job.key)


def enqueue(dsn: str, schema: str, items: list[NewJob]) -> None:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue_many(items)


def drain(dsn: str, schema: str, effect: Ordered, batch_size: int) -> None:
    Dispatcher(dsn, [effect], schema=schema, concurrency=1, batch_size=batch_size,
               prefetch=0).run_until_idle(timeout=60)


def test_a_small_group_is_not_queued_behind_a_large_one(dsn: str, schema: str) -> None:
    enqueue(dsn, schema, [NewJob("test.ordered", f"a-{i}", {}, group="tenant-a")
                          for i in range(300)])
    enqueue(dsn, schema, [NewJob("test.ordered", f"b-{i}", {}, group="tenant-b")
                          for i in range(5)])
    effect = Ordered()
    drain(dsn, schema, effect, batch_size=4)
    assert len(effect.order) == 305
    last_b = max(effect.order.index(f"b-{i}") for i in range(5))
    # claims of 4 go round both groups: B's 5 jobs are among the first 3 claims
    assert last_b < 12, effect.order[:20]


def test_every_busy_group_gets_turns_when_there_are_more_groups_than_a_claim(
    dsn: str, schema: str,
) -> None:
    # 30 groups of 10 jobs, claims of 4: a walk restarting at the first group each
    # claim would serve groups 0..3 until they are empty
    enqueue(dsn, schema, [NewJob("test.ordered", f"g{g:02d}-{i}", {}, group=f"g{g:02d}")
                          for i in range(10) for g in range(30)])
    effect = Ordered()
    drain(dsn, schema, effect, batch_size=4)
    first_round = {key.split("-")[0] for key in effect.order[:30]}
    assert len(first_round) == 30, effect.order[:30]


def test_jobs_without_a_group_are_a_group_of_their_own(dsn: str, schema: str) -> None:
    enqueue(dsn, schema, [NewJob("test.ordered", f"n-{i}", {}) for i in range(100)])
    enqueue(dsn, schema, [NewJob("test.ordered", "g-0", {}, group="g")])
    effect = Ordered()
    drain(dsn, schema, effect, batch_size=2)
    assert effect.order.index("g-0") < 4
    with psycopg.connect(dsn) as conn:
        stored = jobs(conn, schema)
    assert stored["g-0"]["group_key"] == "g" and stored["n-0"]["group_key"] is None
    assert stored["g-0"]["priority"] == 0


def test_a_priority_overtakes_the_backlog_of_its_group(dsn: str, schema: str) -> None:
    enqueue(dsn, schema, [NewJob("test.ordered", f"low-{i}", {}) for i in range(200)])
    enqueue(dsn, schema, [NewJob("test.ordered", f"high-{i}", {}, priority=10)
                          for i in range(5)])
    effect = Ordered()
    drain(dsn, schema, effect, batch_size=5)
    assert sorted(effect.order[:5]) == [f"high-{i}" for i in range(5)]
    assert len(effect.order) == 205  # the lower ones still finish


def test_ageing_a_lower_job_due_long_enough_ago_goes_first(dsn: str, schema: str) -> None:
    # priority 10 counts as 100 s of waiting: a priority 0 job due 200 s ago precedes it
    past = datetime.now(UTC) - timedelta(seconds=200)
    enqueue(dsn, schema, [NewJob("test.ordered", "old-low", {}, run_at=past),
                          NewJob("test.ordered", "new-high", {}, priority=10)])
    effect = Ordered()
    drain(dsn, schema, effect, batch_size=1)
    assert effect.order == ["old-low", "new-high"]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"group": ""}, "group must not be empty"),
    ({"group": "x" * 256}, "at most 255"),
    ({"group": 7}, "group must be a string"),
    ({"priority": 1001}, "between -1000 and 1000"),
    ({"priority": "high"}, "priority must be an integer"),
    ({"priority": True}, "priority must be an integer"),
])
def test_a_bad_group_or_priority_is_refused_before_anything_is_sent(
    dsn: str, schema: str, kwargs: dict[str, object], message: str,
) -> None:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        with pytest.raises(InvalidArgument, match=message):
            tx.enqueue("test.ordered", key="k", payload={}, **kwargs)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match=r"job #0 \('k'\).*" + message):
            tx.enqueue_many([NewJob("test.ordered", "k", {}, **kwargs)])  # type: ignore[arg-type]


def test_perform_is_told_the_group_and_priority_the_job_was_enqueued_with(
        dsn: str, schema: str) -> None:
    seen: dict[str, tuple[str | None, int]] = {}

    class Routing(Effect):
        name = "test.ordered"

        def perform(self, job: Job) -> None:
            seen[job.key] = (job.group, job.priority)

    enqueue(dsn, schema, [NewJob("test.ordered", key="acme-1", payload={}, group="acme",
                                 priority=7),
                          NewJob("test.ordered", key="plain-1", payload={})])
    Dispatcher(dsn, [Routing()], schema=schema).run_until_idle(timeout=60)
    assert seen == {"acme-1": ("acme", 7), "plain-1": (None, 0)}


def _jobs_rows_read(node: dict[str, Any]) -> float:
    """Rows the plan node and those under it read from ``jobs``: those returned plus those
    removed by a filter, over all loops (EXPLAIN gives both per loop)."""
    read = 0.0
    if node.get("Relation Name") == "jobs":
        read += (node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0)) \
            * node.get("Actual Loops", 1)
    return read + sum(_jobs_rows_read(child) for child in node.get("Plans", []))


@pytest.mark.parametrize("analyzed", [True, False], ids=["analyzed", "no-statistics"])
def test_a_claim_of_an_effect_with_nothing_due_reads_no_other_effects_backlog(
        dsn: str, schema: str, analyzed: bool) -> None:
    # A dispatcher serving only "test.idle" (or a core claim while its other effects are
    # limited) beside 3,000 due jobs of "test.busy": its claim, run every poll, must not
    # walk them. It did: the top-up read every due job of every effect, filtering on the
    # effect (0.1 s a claim behind 100,000).
    enqueue(dsn, schema, [NewJob("test.busy", f"busy-{i}", {}) for i in range(3000)])
    query = outbox.sql.queries(schema).claim
    params = {"effects": ["test.idle"], "limit": 500, "lease": 60.0, "worker": "w",
              "after": "{}"}
    with psycopg.connect(dsn) as conn:
        if analyzed:
            conn.execute(sql.SQL("ANALYZE {}.jobs").format(sql.Identifier(schema)))
        row = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + query, params).fetchone()
        conn.rollback()  # EXPLAIN ANALYZE ran the claim: take nothing
    assert row is not None
    [explained] = row[0]
    read = _jobs_rows_read(explained["Plan"])
    assert read < 50, f"the claim read {read:.0f} rows of jobs to find none"
    # the same claim of the busy effect takes its 500, the oldest first
    with psycopg.connect(dsn, autocommit=True) as conn:
        claimed = conn.execute(query, {**params, "effects": ["test.busy"]}).fetchall()
    assert sorted(int(key.split("-")[1]) for key in (r[2] for r in claimed)) == list(range(500))


def test_the_top_up_takes_the_oldest_due_jobs_across_the_effects_claimed(
        dsn: str, schema: str) -> None:
    # Two groups of "test.a" hold only jobs not due yet: they are busy, take a share of
    # the claim each and fill none of it. The groups' heads (a-1, b-2) leave two places,
    # which the top-up fills with the oldest due jobs of either effect: a-3, then b-4.
    start = datetime.now(UTC) - timedelta(minutes=10)
    due = [NewJob(f"test.{e}", f"{e}-{n}", {}, run_at=start + timedelta(seconds=n))
           for e, n in (("a", 1), ("b", 2), ("a", 3), ("b", 4), ("a", 5), ("b", 6))]
    later = [NewJob("test.a", f"later-{g}", {}, run_at=timedelta(hours=1), group=f"g{g}")
             for g in range(2)]
    enqueue(dsn, schema, due + later)
    query = outbox.sql.queries(schema).claim
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("ANALYZE {}.jobs").format(sql.Identifier(schema)))
        claimed = conn.execute(query, {"effects": ["test.a", "test.b"], "limit": 4,
                                       "lease": 60.0, "worker": "w", "after": "{}"}).fetchall()
        # what the merge left out was locked only for the claim: the next claim takes it
        following = conn.execute(query, {"effects": ["test.a", "test.b"], "limit": 4,
                                         "lease": 60.0, "worker": "w",
                                         "after": "{}"}).fetchall()
    assert sorted(r[2] for r in claimed) == ["a-1", "a-3", "b-2", "b-4"]
    assert sorted(r[2] for r in following) == ["a-5", "b-6"]
