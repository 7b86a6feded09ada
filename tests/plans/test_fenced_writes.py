"""The fenced writes about claims read their batch's jobs only, by the primary key, even
when thousands of jobs are running and the statistics were taken while none was (a
drain's start: the queue filled in bulk, analyzed, then claimed; a recorder lagging its
claimer with hooks holds 3,500 to 4,000 claims not yet recorded).

With ``j.status = 'running'`` in the fence the planner took the partial index of the
running jobs (``jobs_leases``) for nearly empty and hashed the batch against every
running job: 4,000 rows read for a segment of 17. Each statement runs under
EXPLAIN (ANALYZE) as the server plans it on its first executions (a custom plan) and
once the dispatcher's connection has prepared it (a generic plan), in a transaction
rolled back, so the data set is the same for every test.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from typing import Any

import psycopg
import pytest
from psycopg import sql

from outbox._dispatch.flowsql import flow_queries
from outbox.sql import queries
from outbox.testing import create_schema, drop_schema

PENDING = 20_000
RUNNING = 4_000  # claimed after the statistics were taken
MODES = ("force_custom_plan", "force_generic_plan")


@pytest.fixture(scope="module")
def lagging(dsn: str) -> Iterator[str]:
    """A schema with ``PENDING`` jobs analyzed while none ran, then ``RUNNING`` of them
    claimed (claim_version 1), as a lagging recorder leaves them."""
    schema = create_schema(dsn)
    jobs = sql.Identifier(schema, "jobs")
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("""
                INSERT INTO {} (effect, key, payload, fingerprint)
                SELECT 'plan.noop', 'job-' || n, '{{}}', 'f'
                FROM generate_series(1, %(n)s) AS n""").format(jobs), {"n": PENDING})
            conn.execute(sql.SQL("VACUUM ANALYZE {}").format(jobs))
            conn.execute(sql.SQL("""
                UPDATE {} SET status = 'running', attempts = 1, claim_version = 1,
                    claimed_by = 'w', first_attempted_at = now(),
                    lease_until = now() + interval '10 minutes'
                WHERE id IN (SELECT id FROM {} ORDER BY id LIMIT %(n)s)""").format(
                jobs, jobs), {"n": RUNNING})
        yield schema
    finally:
        drop_schema(dsn, schema)


def running_ids(dsn: str, schema: str, count: int) -> list[int]:
    """``count`` running jobs from the middle of the running set."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(sql.SQL(
            "SELECT id FROM {} WHERE status = 'running' ORDER BY id OFFSET %s LIMIT %s")
            .format(sql.Identifier(schema, "jobs")), (RUNNING // 2, count)).fetchall()
    assert len(rows) == count
    return [job_id for job_id, in rows]


def scanned(dsn: str, query: str, params: Mapping[str, Any], mode: str) -> dict[str, float]:
    """Rows of jobs each scan of ``query`` read (returned plus filtered out, times its
    loops), by index (or "Seq Scan"), planned as ``mode`` says; rolled back."""
    names: list[str] = []

    def placeholder(match: re.Match[str]) -> str:
        if match[1] not in names:
            names.append(match[1])
        return f"${names.index(match[1]) + 1}"

    prepared = re.sub(r"%\((\w+)\)s", placeholder, query)
    values = sql.SQL(", ").join(sql.Literal(params[name]) for name in names)
    with psycopg.connect(dsn) as conn:
        try:
            conn.execute(sql.SQL("SET LOCAL plan_cache_mode = {}").format(sql.SQL(mode)))
            conn.execute(sql.SQL("PREPARE fenced AS {}").format(sql.SQL(prepared)))
            [(found,)] = conn.execute(sql.SQL(
                "EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE fenced ({})").format(values)).fetchall()
        finally:
            conn.rollback()
    plan = (found if isinstance(found, list) else json.loads(found))[0]["Plan"]
    read: dict[str, float] = {}
    stack = [plan]
    while stack:
        node = stack.pop()
        stack.extend(node.get("Plans", []))
        if node.get("Relation Name") == "jobs" and "Scan" in node["Node Type"]:
            where = node.get("Index Name") or node["Node Type"]
            read[where] = read.get(where, 0.0) + float(
                (node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0))
                * node.get("Actual Loops", 1))
    return read


def batch_params(name: str, ids: list[int]) -> dict[str, Any]:
    if name in ("complete", "complete_delete"):
        return {"claims": json.dumps([{"id": i, "version": 1, "result": {"ok": True}}
                                      for i in ids])}
    if name == "settle":
        return {"claims": json.dumps([{"id": i, "version": 1, "status": "failed",
                                       "delay": 0.0, "error": "boom", "refund": False}
                                      for i in ids])}
    assert name == "heartbeat"
    return {"claims": json.dumps([{"id": i, "version": 1} for i in ids]), "lease": 30.0}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("size", [17, 500])  # a segment, a chunk of hooked outcomes
@pytest.mark.parametrize("name", ["complete", "complete_delete", "settle", "heartbeat"])
def test_a_fenced_batch_write_reads_its_claims_by_the_primary_key_only(
        dsn: str, lagging: str, name: str, size: int, mode: str) -> None:
    ids = running_ids(dsn, lagging, size)
    read = scanned(dsn, getattr(queries(lagging), name), batch_params(name, ids), mode)
    # one probe a claim, each finding its job; never the running set (4,000 rows)
    assert read == {"jobs_pkey": size}, read


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["keep_result", "fail_performed"])
def test_a_raising_hooks_settlement_reads_its_one_job(
        dsn: str, lagging: str, name: str, mode: str) -> None:
    [job_id] = running_ids(dsn, lagging, 1)
    params = {"id": job_id, "version": 1, "result": '{"ok": true}', "delay": 5.0,
              "error": "the hook raised"}
    read = scanned(dsn, getattr(flow_queries(lagging), name), params, mode)
    assert read == {"jobs_pkey": 1}, read
