"""Migrations under whatever isolation the database or role defaults to, and from several
``outbox migrate`` processes started at once."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

import outbox
from outbox import SchemaError
from outbox.migrate import latest_version, migrations

PROCESSES = 4
LEVELS = ["repeatable read", "serializable"]


@pytest.fixture
def database(dsn: str) -> Iterator[str]:
    """A database of the test's own (its settings are the test's to change)."""
    name = f"mig_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    yield make_conninfo(dsn, dbname=name)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture
def role(dsn: str, database: str) -> Iterator[str]:
    """A login role allowed to create schemas in ``database``; returns its name."""
    name = f"mig_{uuid.uuid4().hex[:10]}"
    dbname = psycopg.conninfo.conninfo_to_dict(database)["dbname"]
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
        conn.execute(sql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(
            sql.Identifier(str(dbname)), sql.Identifier(name)))
    yield name
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP OWNED BY {} CASCADE").format(sql.Identifier(name)))
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def _set_default(conninfo: str, target: sql.Composable, level: str) -> None:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(sql.SQL("ALTER {} SET default_transaction_isolation = {}").format(
            target, sql.Literal(level)))


def _lock_key(schema: str) -> str:
    return f"outbox.migrate:{schema}"


def _waiting_on_advisory_lock(conn: psycopg.Connection[tuple[object, ...]]) -> int:
    row = conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND wait_event_type = 'Lock' AND wait_event = 'advisory'").fetchone()
    return int(str(row[0])) if row else 0


def _migrate_at_once(conninfo: str, schema: str) -> list[subprocess.CompletedProcess[str]]:
    """Start ``outbox migrate`` processes while the schema's migration lock is held, wait
    until every one is queued on it, then let them all go."""
    with psycopg.connect(conninfo, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(hashtextextended(%s, 0))", (_lock_key(schema),))
        procs = [subprocess.Popen(
            [sys.executable, "-m", "outbox.cli", "migrate", "--dsn", conninfo,
             "--schema", schema], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(PROCESSES)]
        deadline = time.monotonic() + 60
        while _waiting_on_advisory_lock(holder) < PROCESSES:
            assert time.monotonic() < deadline, "the migrate processes never queued on the lock"
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
            time.sleep(0.05)
        holder.execute("SELECT pg_advisory_unlock(hashtextextended(%s, 0))",
                       (_lock_key(schema),))
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


def _applied(conninfo: str, schema: str) -> list[int]:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        return [v for (v,) in conn.execute(sql.SQL(
            "SELECT version FROM {}.schema_migrations ORDER BY version").format(
            sql.Identifier(schema)))]


def _assert_migrated_once(conninfo: str, schema: str,
                          results: list[subprocess.CompletedProcess[str]]) -> None:
    assert [r.returncode for r in results] == [0] * PROCESSES, [r.stderr for r in results]
    assert sum("applied" in r.stdout for r in results) == 1, [r.stdout for r in results]
    assert _applied(conninfo, schema) == [m.version for m in migrations()]


@pytest.mark.parametrize("level", LEVELS)
def test_concurrent_migrate_commands_under_a_database_default(database: str, level: str) -> None:
    dbname = psycopg.conninfo.conninfo_to_dict(database)["dbname"]
    _set_default(database, sql.SQL("DATABASE {}").format(sql.Identifier(str(dbname))), level)
    with psycopg.connect(database) as conn:
        assert conn.execute("SHOW default_transaction_isolation").fetchone() == (level,)
    _assert_migrated_once(database, "outbox", _migrate_at_once(database, "outbox"))


@pytest.mark.parametrize("level", LEVELS)
def test_concurrent_migrate_commands_under_a_role_default(
    database: str, role: str, level: str
) -> None:
    _set_default(database, sql.SQL("ROLE {}").format(sql.Identifier(role)), level)
    as_role = make_conninfo(database, user=role)
    with psycopg.connect(as_role) as conn:
        assert conn.execute("SHOW default_transaction_isolation").fetchone() == (level,)
    _assert_migrated_once(as_role, "app_outbox", _migrate_at_once(as_role, "app_outbox"))


def test_migrate_on_a_non_autocommit_connection_keeps_its_isolation(database: str) -> None:
    with psycopg.connect(database) as conn:
        conn.isolation_level = psycopg.IsolationLevel.SERIALIZABLE
        assert outbox.migrate(conn, schema="s1") == [m.version for m in migrations()]
        assert conn.isolation_level == psycopg.IsolationLevel.SERIALIZABLE
        assert outbox.migrate(conn, schema="s1") == []


def test_a_joined_repeatable_read_transaction_reports_a_concurrent_run(database: str) -> None:
    with psycopg.connect(database) as conn:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        conn.execute("SELECT 1")  # the snapshot is taken: the caller's transaction is open
        with psycopg.connect(database, autocommit=True) as other:
            outbox.migrate(other, schema="s2")
        with pytest.raises(SchemaError, match="migrated by another process.*run migrate again"):
            outbox.migrate(conn, schema="s2")
        conn.rollback()
        assert outbox.migrate(conn, schema="s2") == []
    assert _applied(database, "s2")[-1] == latest_version()
