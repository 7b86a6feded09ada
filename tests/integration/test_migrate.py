"""Migrations: idempotent, concurrent-safe, and giving the schema the code expects."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

import outbox
from outbox import SchemaError
from outbox.migrate import current_version, latest_version, migrations, require_current

JOBS_COLUMNS = {
    "id": "bigint", "effect": "text", "key": "text", "payload": "jsonb", "status": "text",
    "attempts": "integer", "max_attempts": "integer", "claim_version": "bigint",
    "available_at": "timestamp with time zone", "lease_until": "timestamp with time zone",
    "claimed_by": "text", "ordering_key": "text", "last_error": "text",
    "created_at": "timestamp with time zone", "updated_at": "timestamp with time zone",
}
LEDGER_COLUMNS = {
    "key": "text", "effect": "text", "job_id": "bigint", "claim_version": "bigint",
    "result": "jsonb", "recorded_at": "timestamp with time zone",
}


@pytest.fixture
def fresh_schema(dsn: str) -> Iterator[str]:
    name = f'm "{uuid.uuid4().hex[:8]}"; select 1'
    yield name
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


def _columns(
    conn: psycopg.Connection[tuple[object, ...]], schema: str, table: str
) -> dict[str, str]:
    rows = conn.execute(
        "SELECT column_name, data_type FROM information_schema.columns "
        "WHERE table_schema = %s AND table_name = %s", (schema, table)).fetchall()
    return {str(name): str(kind) for name, kind in rows}


def test_applying_every_migration_gives_the_contract_schema(dsn: str, fresh_schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        applied = outbox.migrate(conn, schema=fresh_schema)
        assert applied == [m.version for m in migrations()]
        jobs = _columns(conn, fresh_schema, "jobs")
        ledger = _columns(conn, fresh_schema, "effect_results")
        assert JOBS_COLUMNS.items() <= jobs.items()
        assert LEDGER_COLUMNS.items() <= ledger.items()
        checks = conn.execute(
            "SELECT pg_get_constraintdef(c.oid) FROM pg_constraint c "
            "JOIN pg_class t ON t.oid = c.conrelid JOIN pg_namespace n ON n.oid = t.relnamespace "
            "WHERE n.nspname = %s AND t.relname = 'jobs' AND c.contype IN ('c', 'u')",
            (fresh_schema,)).fetchall()
        # The statuses are guarded by the function the table's check calls (0021).
        guard = conn.execute(
            "SELECT pg_get_functiondef(p.oid) FROM pg_proc p "
            "JOIN pg_namespace n ON n.oid = p.pronamespace "
            "WHERE n.nspname = %s AND p.proname = 'jobs_row_valid'", (fresh_schema,)).fetchall()
        text = " ".join(str(c[0]) for c in checks + guard)
        assert "jobs_row_valid(" in text
        for status in ("pending", "running", "done", "failed", "reconcile"):
            assert f"'{status}'" in text
        assert "UNIQUE (key)" in text
        options = conn.execute(
            "SELECT reloptions FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %s AND c.relname = 'jobs'", (fresh_schema,)).fetchone()
        assert options is not None and any("autovacuum" in o for o in options[0])
        assert current_version(conn, fresh_schema) == latest_version()


def test_migrate_is_idempotent(dsn: str, fresh_schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        outbox.migrate(conn, schema=fresh_schema)
        assert outbox.migrate(conn, schema=fresh_schema) == []


def test_concurrent_migrations_apply_once(dsn: str, fresh_schema: str) -> None:
    results: list[list[int]] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(6)

    def run() -> None:
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                barrier.wait()
                results.append(outbox.migrate(conn, schema=fresh_schema))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(map(len, results)) == [0] * 5 + [latest_version()]


def test_migrate_joins_an_open_transaction(dsn: str, fresh_schema: str) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute("SELECT 1")  # opens a transaction
        outbox.migrate(conn, schema=fresh_schema)
        conn.rollback()
        assert current_version(conn, fresh_schema) is None


def test_unmigrated_schema_is_reported_clearly(dsn: str, fresh_schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn, \
            pytest.raises(SchemaError, match="has no outbox tables: run `outbox migrate`"):
        require_current(conn, fresh_schema)


def test_newer_schema_is_refused(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("INSERT INTO {}.schema_migrations (version, name) VALUES (999, 'x')")
                     .format(sql.Identifier(schema)))
        with pytest.raises(SchemaError, match="newer than this code knows"):
            require_current(conn, schema)
        with pytest.raises(SchemaError, match="refusing to migrate"):
            outbox.migrate(conn, schema=schema)


def test_the_inbox_table_has_its_key_and_retention_index(dsn: str, fresh_schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        outbox.migrate(conn, schema=fresh_schema)
        assert _columns(conn, fresh_schema, "inbox") == {
            "consumer": "text", "message_id": "text",
            "received_at": "timestamp with time zone"}
        indexes = conn.execute(
            "SELECT indexdef FROM pg_indexes WHERE schemaname = %s AND tablename = 'inbox'",
            (fresh_schema,)).fetchall()
        definitions = " ".join(str(row[0]) for row in indexes)
        assert "(consumer, message_id)" in definitions
        assert "(received_at)" in definitions
