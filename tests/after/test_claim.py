"""The claim passes waiting children by without reading them: 5,000 children of one
pending parent, in the same effect and group as the due jobs claimed, cost the claim no
read of theirs (the plan's own counts of the rows it read, not a timing)."""

from __future__ import annotations

import json
from typing import Any

import psycopg

import outbox
from outbox.sql import queries

CHILDREN = 5000


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
                         for i in range(20)])
    with psycopg.connect(dsn) as conn:
        conn.execute(f'ANALYZE "{schema}".jobs')
        [(plan,)] = conn.execute(
            "EXPLAIN (ANALYZE, FORMAT JSON) " + queries(schema).claim,
            {"effects": ["test.work"], "limit": 50, "lease": 30.0, "worker": "w",
             "after": "{}"}).fetchall()
        claimed = conn.execute(f"""SELECT count(*) FROM "{schema}".jobs
                                   WHERE status = 'running'""").fetchone()
        conn.rollback()
    nodes = _nodes((plan if isinstance(plan, list) else json.loads(plan))[0]["Plan"])
    scans = [n for n in nodes if n.get("Relation Name") == "jobs" and "Index Name" in n]
    read = sum(n["Actual Rows"] * n["Actual Loops"] + n.get("Rows Removed by Filter", 0)
               for n in scans)
    assert claimed == (20,)  # every due job, none of the waiting children
    assert read < CHILDREN / 10, [(n["Index Name"], n["Actual Rows"],
                                   n.get("Rows Removed by Filter")) for n in scans]
