"""The claim passes waiting children by without reading them: 5,000 children of one
pending parent, in the same effect and group as the 3,000 due jobs a claim of 4,000 takes
(more than are due, so the walk of the group's jobs in claim order reaches its end), are
not read and filtered out one by one: the fair claim's walk stops at the rank no due job
passes. Shown by the plan's own counts of the rows it filtered out, not by a timing."""

from __future__ import annotations

import json
from typing import Any

import psycopg

import outbox
from outbox.sql import queries

CHILDREN = 5000
DUE = 3000
LIMIT = 4000


def _nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    found = [plan]
    for child in plan.get("Plans", []):
        found += _nodes(child)
    return found


def test_a_claim_reads_none_of_the_children_waiting_beside_the_due_jobs(
        dsn: str, schema: str) -> None:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue("other.work", key="parent", payload={})
        tx.enqueue_many([outbox.NewJob("test.work", key=f"child-{i}", payload={},
                                       after=["parent"]) for i in range(CHILDREN)])
        tx.enqueue_many([outbox.NewJob("test.work", key=f"due-{i}", payload={})
                         for i in range(DUE)])
    with psycopg.connect(dsn) as conn:
        conn.execute(f'ANALYZE "{schema}".jobs')
        [(plan,)] = conn.execute(
            "EXPLAIN (ANALYZE, FORMAT JSON) " + queries(schema).claim,
            {"effects": ["test.work"], "limit": LIMIT, "lease": 30.0, "worker": "w",
             "after": "{}"}).fetchall()
        claimed = conn.execute(f"""SELECT count(*) FROM "{schema}".jobs
                                   WHERE status = 'running'""").fetchone()
        conn.rollback()
    nodes = _nodes((plan if isinstance(plan, list) else json.loads(plan))[0]["Plan"])
    walks = [n for n in nodes if n.get("Index Name") == "jobs_fair"]  # the fair claim's
    filtered = sum(n.get("Rows Removed by Filter", 0) * n["Actual Loops"] for n in walks)
    assert claimed == (DUE,)  # every due job, none of the waiting children
    assert walks and filtered < CHILDREN / 10, [
        (n["Actual Rows"], n.get("Rows Removed by Filter")) for n in walks]
