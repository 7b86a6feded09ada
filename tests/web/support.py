"""Seeding and reading helpers for the dashboard tests (real PostgreSQL throughout)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from psycopg import sql

JOB_COLUMNS = ("effect", "key", "payload", "status", "attempts", "claim_version",
               "last_error", "lease_until", "claimed_by", "available_at", "created_at",
               "updated_at")


def seed(dsn: str, schema: str, *jobs: dict[str, Any]) -> list[int]:
    """Insert jobs as given (status, versions, errors, times), returning their ids.

    Each job needs ``key``; the rest defaults to a pending ``email.send`` job. A running
    job gets a lease and a worker, as the table's CHECK requires.
    """
    ids = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        for job in jobs:
            row = {"effect": "email.send", "payload": {"to": "a@example.com"},
                   "status": "pending", "attempts": 0, "claim_version": 0,
                   "last_error": None, "lease_until": None, "claimed_by": None,
                   "available_at": None, "created_at": None, "updated_at": None,
                   "ordering_key": None, "group_key": None, **job}
            if row["status"] == "running":
                if row["lease_until"] is None:
                    row["lease_until"] = datetime.now(UTC) + timedelta(hours=1)
                row["claimed_by"] = row["claimed_by"] or "host-1:42"
            row["payload"] = json.dumps(row["payload"])
            query = sql.SQL(
                "INSERT INTO {}.jobs (effect, key, payload, fingerprint, status, attempts,"
                " claim_version, last_error, lease_until, claimed_by, available_at,"
                " created_at, updated_at, ordering_key, group_key)"
                " VALUES (%(effect)s, %(key)s, %(payload)s::jsonb,"
                " 'seeded', %(status)s, %(attempts)s, %(claim_version)s, %(last_error)s,"
                " %(lease_until)s::timestamptz, %(claimed_by)s,"
                " coalesce(%(available_at)s::timestamptz, now()),"
                " coalesce(%(created_at)s::timestamptz, now()),"
                " coalesce(%(updated_at)s::timestamptz, now()), %(ordering_key)s,"
                " %(group_key)s)"
                " RETURNING id"
            ).format(sql.Identifier(schema))
            found = conn.execute(query, row).fetchone()
            assert found is not None
            ids.append(int(found[0]))
    return ids


def job(dsn: str, schema: str, job_id: int) -> dict[str, Any]:
    """One job row as a dict."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(sql.SQL("SELECT * FROM {}.jobs WHERE id = %s").format(
            sql.Identifier(schema)), (job_id,))
        names = [d.name for d in cur.description or []]
        row = cur.fetchone()
        assert row is not None, f"no job {job_id}"
        return dict(zip(names, row, strict=True))


def audit(dsn: str, schema: str) -> list[dict[str, Any]]:
    """The dashboard's audit rows, oldest first."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(sql.SQL("SELECT * FROM {}.dashboard_audit ORDER BY id").format(
            sql.Identifier(schema)))
        names = [d.name for d in cur.description or []]
        return [dict(zip(names, row, strict=True)) for row in cur]


def ledger(dsn: str, schema: str, key: str) -> dict[str, Any] | None:
    """The ledger row of ``key``, if any."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(sql.SQL("SELECT * FROM {}.effect_results WHERE key = %s").format(
            sql.Identifier(schema)), (key,))
        names = [d.name for d in cur.description or []]
        row = cur.fetchone()
        return dict(zip(names, row, strict=True)) if row else None
