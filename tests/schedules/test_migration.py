"""Migration 0014 on a schema of the previous version: jobs kept (scheduled_for NULL),
the privileges of the roles that use the jobs table granted on the schedules table."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

import outbox
from outbox.sql import bind_schema

SCHEDULES = 14


@pytest.fixture
def old_schema(dsn: str) -> Iterator[str]:
    name = f"old_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        outbox.migrate(conn, schema=name, target=SCHEDULES - 1)
        conn.execute(bind_schema(
            "INSERT INTO {schema}.jobs (effect, key, payload, fingerprint) "
            "VALUES ('email.send', 'before', '{{}}', 'f')", name).encode())
    yield name
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


def test_0014_keeps_the_jobs_and_grants_the_schedules_to_the_dispatchers_roles(
        dsn: str, old_schema: str) -> None:
    worker, reader, other = (f"{kind}_{uuid.uuid4().hex[:8]}"
                             for kind in ("worker", "reader", "other"))
    table = f'"{old_schema}".schedules'
    with psycopg.connect(dsn, autocommit=True) as conn:
        try:
            for role in (worker, reader, other):
                conn.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("GRANT SELECT, INSERT, UPDATE ON {}.jobs TO {}").format(
                sql.Identifier(old_schema), sql.Identifier(worker)))
            conn.execute(sql.SQL("GRANT SELECT ON {}.jobs TO {}").format(
                sql.Identifier(old_schema), sql.Identifier(reader)))
            assert outbox.migrate(conn, schema=old_schema)[0] == SCHEDULES
            privileges = conn.execute(
                "SELECT r, array_agg(p ORDER BY p) FILTER (WHERE has_table_privilege(r, %s, p))"
                " FROM unnest(%s::text[]) r, unnest(ARRAY['DELETE', 'INSERT', 'SELECT',"
                " 'UPDATE']) p GROUP BY r", (table, [worker, reader, other])).fetchall()
            assert dict(privileges) == {worker: ["INSERT", "SELECT", "UPDATE"],
                                        reader: ["SELECT"], other: None}
            [(key, slot)] = conn.execute(sql.SQL("SELECT key, scheduled_for FROM {}.jobs")
                                         .format(sql.Identifier(old_schema))).fetchall()
            assert (key, slot) == ("before", None)
        finally:
            for role in (worker, reader, other):
                conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
                conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
