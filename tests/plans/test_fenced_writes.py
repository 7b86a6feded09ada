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

Nor may a plan read the batch again for each job. With the statistics taken while the
table was small and no job ran (300 jobs analyzed, 4,700 more enqueued, 2,000 claimed: a
fresh deployment's first drains) the planner counted on about one running job and, when
the statements joined their batch with jobs, read the whole batch once per running job
(a nested loop: 4,000,000 rows compared for a batch of 2,000). Each statement's plan is
checked node by node: jobs read by jobs_pkey only, and no node of the plan producing more
than about twice the batch over all its executions.
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
FENCED = ["complete", "complete_delete", "settle", "heartbeat", "lock_claims"]
SMALL, ADDED, CLAIMED = 300, 4_700, 2_000  # a fresh deployment's first drain


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


@pytest.fixture(scope="module")
def fresh(dsn: str) -> Iterator[str]:
    """A schema analyzed at ``SMALL`` pending jobs, then ``ADDED`` more enqueued and
    ``CLAIMED`` of them claimed (claim_version 1), no ANALYZE since: the statistics of a
    fresh deployment's first drain (about one running job expected)."""
    schema = create_schema(dsn)
    jobs = sql.Identifier(schema, "jobs")
    enqueue = sql.SQL("""
        INSERT INTO {} (effect, key, payload, fingerprint)
        SELECT 'plan.noop', 'job-' || n, '{{}}', 'f'
        FROM generate_series(%(first)s::int, %(last)s::int) AS n""").format(jobs)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(enqueue, {"first": 1, "last": SMALL})
            conn.execute(sql.SQL("ANALYZE {}").format(jobs))
            conn.execute(enqueue, {"first": SMALL + 1, "last": SMALL + ADDED})
            conn.execute(sql.SQL("""
                UPDATE {} SET status = 'running', attempts = 1, claim_version = 1,
                    claimed_by = 'w', first_attempted_at = now(),
                    lease_until = now() + interval '10 minutes'
                WHERE id IN (SELECT id FROM {} ORDER BY id LIMIT %(n)s)""").format(
                jobs, jobs), {"n": CLAIMED})
        yield schema
    finally:
        drop_schema(dsn, schema)


def running_ids(dsn: str, schema: str, count: int, offset: int = RUNNING // 2) -> list[int]:
    """``count`` running jobs from ``offset`` on (the middle of the lagging set)."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(sql.SQL(
            "SELECT id FROM {} WHERE status = 'running' ORDER BY id OFFSET %s LIMIT %s")
            .format(sql.Identifier(schema, "jobs")), (offset, count)).fetchall()
    assert len(rows) == count
    return [job_id for job_id, in rows]


def explained(dsn: str, query: str, params: Mapping[str, Any], mode: str) -> dict[str, Any]:
    """The plan of ``query`` run under EXPLAIN (ANALYZE), planned as ``mode`` says (a
    prepared statement: custom or generic plan); rolled back."""
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
    plan: dict[str, Any] = (found if isinstance(found, list) else json.loads(found))[0]["Plan"]
    return plan


def nodes(plan: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """Every node of ``plan``, its subplans' and initplans' too."""
    stack = [plan]
    while stack:
        node = stack.pop()
        stack.extend(node.get("Plans", []))
        yield node


def read_by_index(plan: Mapping[str, Any]) -> dict[str, float]:
    """Rows of jobs each scan of ``plan`` read (returned plus filtered out, times its
    loops), by index (a bitmap heap scan by its bitmap's index), or "Seq Scan"."""
    read: dict[str, float] = {}
    for node in nodes(plan):
        if node.get("Relation Name") == "jobs" and "Scan" in node["Node Type"]:
            where = node.get("Index Name") or node["Node Type"]
            if node["Node Type"] == "Bitmap Heap Scan":
                [bitmap] = node["Plans"]
                where = bitmap.get("Index Name", "Bitmap Heap Scan")
            read[where] = read.get(where, 0.0) + float(
                (node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0))
                * node.get("Actual Loops", 1))
    return read


def scanned(dsn: str, query: str, params: Mapping[str, Any], mode: str) -> dict[str, float]:
    """Rows of jobs each scan of ``query`` read, by index (``read_by_index``)."""
    return read_by_index(explained(dsn, query, params, mode))


def busiest(plan: Mapping[str, Any]) -> tuple[float, str]:
    """The most rows any one node of ``plan`` handled over all its executions (returned
    plus removed by a filter or a join filter, times its loops), and that node. A bitmap
    index scan is left out: it counts index entries, dead ones too (the versions a claim
    or an update rolled back left behind), its heap scan the rows."""
    most, which = 0.0, ""
    for node in nodes(plan):
        if node["Node Type"] == "Bitmap Index Scan":
            continue
        handled = (node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0)
                   + node.get("Rows Removed by Join Filter", 0)) * node.get("Actual Loops", 1)
        if handled > most:
            most, which = float(handled), f"{node['Node Type']} x{node.get('Actual Loops', 1)}"
    return most, which


def batch_params(name: str, ids: list[int]) -> dict[str, Any]:
    if name in ("complete", "complete_delete"):
        return {"claims": json.dumps([{"id": i, "version": 1, "result": {"ok": True}}
                                      for i in ids])}
    if name == "settle":
        return {"claims": json.dumps([{"id": i, "version": 1, "status": "failed",
                                       "delay": 0.0, "error": "boom", "refund": False}
                                      for i in ids])}
    if name == "lock_claims":
        return {"claims": json.dumps([{"id": i, "version": 1} for i in ids])}
    assert name == "heartbeat"
    return {"claims": json.dumps([{"id": i, "version": 1} for i in ids]), "lease": 30.0}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("size", [17, 500])  # a segment, a chunk of hooked outcomes
@pytest.mark.parametrize("name", FENCED)
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


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("size", [1, 17, CLAIMED])  # one, a segment, a drain's batch
@pytest.mark.parametrize("name", FENCED)
def test_no_fenced_batch_write_reads_its_batch_again_for_each_job(
        dsn: str, fresh: str, name: str, size: int, mode: str) -> None:
    ids = running_ids(dsn, fresh, size, offset=0)
    plan = explained(dsn, getattr(queries(fresh), name), batch_params(name, ids), mode)
    # jobs found by their primary key (an index or a bitmap scan of it), once each
    # (a bitmap may also see the claim's dead versions: at most one a job)
    read = read_by_index(plan)
    assert read.keys() == {"jobs_pkey"} and size <= read["jobs_pkey"] <= 2 * size, read
    # and no node handling more than the batch about twice (the bug: the batch read
    # once per running job, 4,000,000 rows for 2,000)
    most, which = busiest(plan)
    assert most <= 2 * size + 2, (most, which)
    # the batch itself read once
    assert once_over_the_batch(plan)
    # every job of the batch written: fenced on its own claim (id and version)
    assert plan["Actual Rows"] == size


def once_over_the_batch(plan: Mapping[str, Any]) -> bool:
    """Whether every scan of the batch (a function of %(claims)s) in ``plan`` ran once."""
    scans = [node for node in nodes(plan) if node["Node Type"] == "Function Scan"]
    return bool(scans) and all(node.get("Actual Loops", 1) == 1 for node in scans)


@pytest.mark.parametrize("mode", MODES)
def test_a_stale_claim_is_fenced_out_by_its_version(
        dsn: str, fresh: str, mode: str) -> None:
    ids = running_ids(dsn, fresh, 17, offset=0)
    params = {"claims": json.dumps([{"id": i, "version": 1 if i % 2 else 2, "result": None}
                                    for i in ids])}
    plan = explained(dsn, queries(fresh).complete, params, mode)
    assert plan["Actual Rows"] == sum(1 for i in ids if i % 2)
    # a job in the batch at two versions (an outcome of its former claim waiting while
    # it is claimed again): its current claim is the one written, before or after
    for versions in ((2, 1), (1, 2)):
        params = {"claims": json.dumps([{"id": i, "version": v, "result": None}
                                        for i in ids for v in versions])}
        plan = explained(dsn, queries(fresh).complete, params, mode)
        assert plan["Actual Rows"] == len(ids)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("size", [1, CLAIMED])
def test_a_lost_replys_check_reads_its_batch_once(
        dsn: str, fresh: str, size: int, mode: str) -> None:
    ids = running_ids(dsn, fresh, size, offset=0)
    with psycopg.connect(dsn) as conn:  # each claim with its job's key, as the recorder's
        keys: dict[int, str] = dict(conn.execute(
            sql.SQL("SELECT id, key FROM {} WHERE id = ANY(%s)").format(
                sql.Identifier(fresh, "jobs")), (ids,)).fetchall())
    claims = [{"id": i, "version": 1, "key": keys[i]} for i in ids]
    plan = explained(dsn, queries(fresh).recorded_claims, {"claims": json.dumps(claims)}, mode)
    most, which = busiest(plan)
    assert most <= 2 * size + 2, (most, which)
    assert once_over_the_batch(plan)
