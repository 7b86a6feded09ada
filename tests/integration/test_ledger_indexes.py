"""Migration 0023 (drop_ledger_job_index): a ledger row is written to one index fewer;
the check after a lost reply (recorded_claims) finds its claims' rows by their keys, the
runner no longer builds the dropped after-commit index of 0018, and the previous
release's check, which looked for them by job id, answers as before."""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.rows import namedtuple_row

import outbox
from outbox._dispatch.held import Held
from outbox._dispatch.settling import completion_claims, recorded_claims
from outbox._dispatch.state import Success
from outbox.effect import Job
from outbox.migrate import _parse, migrations, wanted_indexes
from outbox.sql import bind_schema, queries

from .helpers import schema_at

# outbox.migrate is also the name of the function the package exports.
migrate_module = importlib.import_module("outbox.migrate")
DROPPED = next(m.version for m in migrations() if m.name == "drop_ledger_job_index")
BUILT = next(m.version for m in migrations() if m.name == "ledger_job_index")

# recorded_claims of the release before the migration: the ledger by job id.
PREVIOUS_RECORDED_CLAIMS = """
WITH claims AS (
    SELECT array_agg(c.id) AS ids,
           jsonb_object_agg(concat(c.id, '/', c.version), c.place - 1) AS by_claim
    FROM ROWS FROM (jsonb_to_recordset(%(claims)s::jsonb) AS (id bigint, version bigint))
         WITH ORDINALITY AS c(id, version, place)
)
SELECT r.job_id
FROM {schema}.effect_results r
WHERE r.job_id = ANY (CAST((SELECT c.ids FROM claims c) AS bigint[]))
  AND (SELECT c.by_claim FROM claims c) ? concat(r.job_id, '/', r.claim_version)
"""

# Keys (printable ASCII) a claim's JSON must carry as they are: a double quote and a
# backslash, which JSON escapes, and what looks like JSON or SQL.
KEYS = ['plain-1', 'quote-"-2', 'back\\slash-3', '{"id":4}', "it's-5", 'last-6\\"']


@pytest.fixture
def before_drop(dsn: str) -> Iterator[str]:
    """A schema migrated up to the version before drop_ledger_job_index."""
    with schema_at(dsn, DROPPED - 1, "ledger") as name:
        yield name


def _ledger_indexes(conn: psycopg.Connection[Any], schema: str) -> set[str]:
    rows = conn.execute("SELECT indexname FROM pg_indexes WHERE schemaname = %s "
                        "AND tablename = 'effect_results'", (schema,)).fetchall()
    return {str(name) for name, in rows}


def test_a_ledger_row_is_written_to_two_indexes(dsn: str, before_drop: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert _ledger_indexes(conn, before_drop) == {
            "effect_results_pkey", "effect_results_recorded", "effect_results_job"}
        assert outbox.migrate(conn, schema=before_drop, target=DROPPED) == [DROPPED]
        assert _ledger_indexes(conn, before_drop) == {
            "effect_results_pkey", "effect_results_recorded"}
        # every later run checks the after-commit indexes of the migrations applied:
        # 0018's, dropped by this one, is not built again
        assert outbox.migrate(conn, schema=before_drop) == [
            m.version for m in migrations() if m.version > DROPPED]
        assert migrate_module.build_indexes(conn, before_drop) == []
        assert "effect_results_job" not in _ledger_indexes(conn, before_drop)


def test_a_schema_created_at_once_has_no_ledger_index_by_job(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert _ledger_indexes(conn, schema) == {
            "effect_results_pkey", "effect_results_recorded"}


def test_the_indexes_wanted_are_those_no_later_migration_dropped() -> None:
    assert "effect_results_job" in {i.name for i in wanted_indexes(DROPPED - 1)}
    assert "effect_results_job" in {i.name for i in wanted_indexes(BUILT)}
    assert "effect_results_job" not in {i.name for i in wanted_indexes(DROPPED)}
    # the others stay wanted
    assert {i.name for i in wanted_indexes(DROPPED)} == (
        {i.name for i in wanted_indexes(DROPPED - 1)} - {"effect_results_job"})
    parsed = _parse(44, "drops", "-- DROP INDEX IF EXISTS {schema}.commented_out;\n"
                                 "DROP INDEX IF EXISTS {schema}.gone;\n"
                                 "drop index concurrently if exists {schema}.gone_too;\n")
    assert parsed.drops == ("gone", "gone_too")


def _claimed(dsn: str, schema: str) -> list[Job]:
    """Enqueue a job a key of KEYS and claim them all: each as the claimer makes it."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        with outbox.transaction(conn, schema=schema) as tx:
            for n, key in enumerate(KEYS):
                tx.enqueue("test.work", key=key, payload={"n": n})
        cur = conn.cursor(row_factory=namedtuple_row)
        rows: list[Any] = cur.execute(queries(schema).claim, {
            "effects": ["test.work"], "limit": 100, "lease": 300.0, "worker": "w",
            "after": "{}"}).fetchall()
    assert sorted(row.key for row in rows) == sorted(KEYS)
    return sorted((Job(id=row.id, effect=row.effect, key=row.key, payload={}, attempt=1,
                       claim_version=row.claim_version) for row in rows),
                  key=lambda job: job.id)


def _held(job: Job, version: int | None = None) -> Held:
    if version is not None:
        job = Job(id=job.id, effect=job.effect, key=job.key, payload={}, attempt=1,
                  claim_version=version)
    return Held(job=job, effect=None, is_async=False)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["complete", "complete_delete"])
def test_the_check_after_a_lost_reply_finds_the_claims_that_landed_by_their_keys(
        dsn: str, schema: str, name: str) -> None:
    jobs = _claimed(dsn, schema)
    landed = jobs[:3]
    with psycopg.connect(dsn, autocommit=True) as conn:
        done = conn.execute(getattr(queries(schema), name), {"claims": completion_claims(
            (_held(job), Success("null")) for job in landed)}).fetchall()
        assert sorted(job_id for job_id, in done) == [job.id for job in landed]
        asked = [_held(job) for job in jobs[1:]]
        # a landed job asked at another version (a later claim of it): not that claim's
        stale = _held(jobs[0], version=jobs[0].claim_version + 1)
        found = conn.execute(queries(schema).recorded_claims,
                             {"claims": recorded_claims([stale, *asked])}).fetchall()
        assert sorted(job_id for job_id, in found) == [job.id for job in landed[1:]]
        # the claims' JSON carries each key as it is
        assert [c["key"] for c in json.loads(recorded_claims(asked))] == [
            job.key for job in jobs[1:]]
        # the previous release's check, by job id, answers alike without 0018's index
        assert "effect_results_job" not in _ledger_indexes(conn, schema)
        previous = conn.execute(bind_schema(PREVIOUS_RECORDED_CLAIMS, schema).encode(), {
            "claims": json.dumps([{"id": h.job.id, "version": h.job.claim_version}
                                  for h in [stale, *asked]])}).fetchall()
        assert sorted(job_id for job_id, in previous) == [job.id for job in landed[1:]]


def test_a_release_older_than_the_schema_builds_none_of_its_indexes(
        dsn: str, schema: str) -> None:
    # An older release's runner cannot know which after-commit indexes a newer schema
    # still has (a newer migration may have dropped one): it builds none.
    newer = migrate_module.latest_version() + 1
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(bind_schema("DROP INDEX {schema}.jobs_fair", schema).encode())
        conn.execute(bind_schema("INSERT INTO {schema}.schema_migrations (version, name) "
                                 "VALUES (%s, 'from_a_newer_release')", schema), (newer,))
        assert migrate_module.build_indexes(conn, schema) == []
        conn.execute(bind_schema("DELETE FROM {schema}.schema_migrations WHERE version = %s",
                                 schema), (newer,))
        assert migrate_module.build_indexes(conn, schema) == ["jobs_fair"]
