"""Migrating a live schema: each migration a transaction of its own (a run that stops
part way, refused a lock or killed, keeps what it applied, and the next goes on), each
lock waited for at most ``lock_timeout`` and tried again (business writes never queue
behind it for longer), and indexes of large tables built CONCURRENTLY after the run
commits, rebuilt by the next run when a build was cut short."""

from __future__ import annotations

import importlib
import logging
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

import outbox
from outbox import SchemaError
from outbox.migrate import AFTER_COMMIT, _parse, latest_version
from outbox.sql import bind_schema
from outbox.testing import job

from .helpers import wait_until

# outbox.migrate is also the name of the function the package exports.
migrate_module = importlib.import_module("outbox.migrate")
GROUPS = 10  # the migration that added jobs_fair, built after commit


@pytest.fixture
def old_schema(dsn: str) -> Iterator[str]:
    """A schema migrated only as far as the version before GROUPS, with a job in it."""
    name = f"old_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert outbox.migrate(conn, schema=name, target=GROUPS - 1) == list(range(1, GROUPS))
        conn.execute(bind_schema(
            "INSERT INTO {schema}.jobs (effect, key, payload, fingerprint) "
            "VALUES ('email.send', 'before', '{{}}', 'f')", name).encode())
    yield name
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


class Warnings(logging.Handler):
    """Collects outbox.migrate's warnings; ``seen`` is set at the first."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen = threading.Event()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
        self.seen.set()


@pytest.fixture
def migrate_warnings() -> Iterator[Warnings]:
    handler = Warnings()
    logger = logging.getLogger("outbox.migrate")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def _index_valid(conn: psycopg.Connection[Any], schema: str, name: str) -> bool | None:
    row = conn.execute(
        "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
        "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relname = %s",
        (schema, name)).fetchone()
    return None if row is None else bool(row[0])


def test_a_migration_waiting_for_a_lock_lets_business_writes_through_and_applies_later(
        dsn: str, old_schema: str, migrate_warnings: Warnings) -> None:
    jobs = sql.SQL("{}.jobs").format(sql.Identifier(old_schema))
    applied: list[list[int]] = []
    failed: list[BaseException] = []
    with psycopg.connect(dsn) as holder, psycopg.connect(dsn, autocommit=True) as business:
        # A long business transaction that read the jobs table: ALTER TABLE must wait for it.
        holder.execute(sql.SQL("SELECT count(*) FROM {}").format(jobs))

        def run() -> None:
            try:
                with psycopg.connect(dsn, autocommit=True) as conn:
                    applied.append(outbox.migrate(conn, schema=old_schema, lock_timeout=0.05))
            except BaseException as exc:  # reported by the assertion below
                failed.append(exc)

        migrating = threading.Thread(target=run)
        migrating.start()
        assert migrate_warnings.seen.wait(30), "the migration never gave up waiting for its lock"
        # Without the lock timeout this insert would queue behind the migration's
        # ACCESS EXCLUSIVE request until the holder commits: it would never return here.
        business.execute("SET statement_timeout = '20s'")
        business.execute(sql.SQL(
            "INSERT INTO {} (effect, key, payload, fingerprint) "
            "VALUES ('email.send', 'during', '{{}}', 'f')").format(jobs))
        holder.commit()
        migrating.join(60)
    assert not migrating.is_alive() and failed == []
    assert applied == [list(range(GROUPS, latest_version() + 1))]
    assert "not granted within 0.05 s" in migrate_warnings.messages[0]
    with psycopg.connect(dsn, autocommit=True) as conn:
        keys = conn.execute(sql.SQL("SELECT key, group_key, priority FROM {} ORDER BY key")
                            .format(jobs)).fetchall()
        assert keys == [("before", None, 0), ("during", None, 0)]
        assert _index_valid(conn, old_schema, "jobs_fair") is True


def test_a_lock_never_granted_leaves_the_schema_as_it_was(
        dsn: str, old_schema: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(migrate_module, "LOCK_ATTEMPTS", 2)
    jobs = sql.SQL("{}.jobs").format(sql.Identifier(old_schema))
    with psycopg.connect(dsn) as holder, psycopg.connect(dsn, autocommit=True) as conn:
        holder.execute(sql.SQL("SELECT count(*) FROM {}").format(jobs))
        with pytest.raises(SchemaError, match=r"not granted within 0.05 s in 2 attempts.*"
                                              r"nothing was changed"):
            outbox.migrate(conn, schema=old_schema, lock_timeout=0.05)
        holder.rollback()
        assert migrate_module.current_version(conn, old_schema) == GROUPS - 1


def _applied_at(conn: psycopg.Connection[Any], schema: str) -> dict[int, Any]:
    """Each version's applied_at: the start of the transaction that applied it."""
    return dict(conn.execute(sql.SQL("SELECT version, applied_at FROM {}.schema_migrations")
                             .format(sql.Identifier(schema))).fetchall())


def test_each_migration_of_an_existing_schema_is_a_transaction_of_its_own(
        dsn: str, old_schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert outbox.migrate(conn, schema=old_schema) == list(range(GROUPS,
                                                                     latest_version() + 1))
        upgraded = _applied_at(conn, old_schema)
        # now() is the start of the transaction: one value for every version of one
        # transaction, another for each later one.
        later = [upgraded[v] for v in range(GROUPS, latest_version() + 1)]
        assert len(set(later)) == len(later)
        assert later == sorted(later) and min(later) > upgraded[GROUPS - 1]


def test_concurrent_runs_on_an_existing_schema_apply_each_version_once_between_them(
        dsn: str, old_schema: str) -> None:
    results: list[list[int]] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def run() -> None:
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                barrier.wait()
                results.append(outbox.migrate(conn, schema=old_schema))
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and len(results) == 4
    assert sorted(v for applied in results for v in applied) == list(
        range(GROUPS, latest_version() + 1))
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert _index_valid(conn, old_schema, "jobs_fair") is True


def test_a_new_schema_gets_every_migration_in_one_transaction(dsn: str) -> None:
    name = f"new_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        try:
            assert outbox.migrate(conn, schema=name) == list(range(1, latest_version() + 1))
            assert len(set(_applied_at(conn, name).values())) == 1
        finally:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(name)))


def test_a_migration_joined_to_a_transaction_applies_every_version_in_it(
        dsn: str, old_schema: str) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute("SELECT 1")
        outbox.migrate(conn, schema=old_schema)
        # The caller's transaction keeps its own settings.
        assert conn.execute("SHOW client_connection_check_interval").fetchone() == ("0",)
        conn.commit()
        upgraded = _applied_at(conn, old_schema)
        assert len({upgraded[v] for v in range(GROUPS, latest_version() + 1)}) == 1


SCHEDULES = 14  # the first migration after GROUPS that alters dashboard_audit


def test_a_lock_never_granted_part_way_keeps_the_versions_applied_before_it(
        dsn: str, old_schema: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(migrate_module, "LOCK_ATTEMPTS", 2)
    audit = sql.SQL("{}.dashboard_audit").format(sql.Identifier(old_schema))
    before = SCHEDULES - 1
    with psycopg.connect(dsn) as holder, psycopg.connect(dsn, autocommit=True) as conn:
        # A long transaction that read the audit table: the migrations before the one
        # that alters it apply, that one waits for the table's lock in vain.
        holder.execute(sql.SQL("SELECT count(*) FROM {}").format(audit))
        with pytest.raises(SchemaError, match=rf"not granted within 0.05 s in 2 attempts.*"
                                              rf"this run applied versions {GROUPS} to {before}"
                                              rf" \(the schema is at version {before}, kept"):
            outbox.migrate(conn, schema=old_schema, lock_timeout=0.05)
        assert migrate_module.current_version(conn, old_schema) == before
        holder.rollback()
        # The next run goes on from there.
        assert outbox.migrate(conn, schema=old_schema) == list(
            range(SCHEDULES, latest_version() + 1))
        assert _index_valid(conn, old_schema, "jobs_fair") is True


def _waiting_for(conn: psycopg.Connection[Any], table: sql.Composed) -> int:
    """How many sessions wait for a lock on ``table``."""
    row = conn.execute("SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = "
                       "%s::regclass", (table.as_string(conn),)).fetchone()
    return 0 if row is None else int(row[0])


def test_a_migrate_killed_between_two_migrations_keeps_the_first_and_the_next_run_goes_on(
        dsn: str, old_schema: str) -> None:
    audit = sql.SQL("{}.dashboard_audit").format(sql.Identifier(old_schema))
    jobs = sql.SQL("{}.jobs").format(sql.Identifier(old_schema))
    with psycopg.connect(dsn) as holder, psycopg.connect(dsn, autocommit=True) as conn:
        holder.execute(sql.SQL("SELECT count(*) FROM {}").format(audit))
        migrating = subprocess.Popen(
            [sys.executable, "-m", "outbox.cli", "migrate", "--dsn", dsn, "--schema",
             old_schema, "--lock-timeout", "600"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            # The versions before the one that alters the audit table commit; that one
            # waits for the holder's lock: the process is between two migrations.
            wait_until(lambda: migrate_module.current_version(conn, old_schema) == SCHEDULES - 1,
                       timeout=30, what=f"version {SCHEDULES - 1} committed")
            wait_until(lambda: _waiting_for(conn, audit) == 1, timeout=30,
                       what="the run waiting for its lock")
            os.kill(migrating.pid, signal.SIGKILL)
            assert migrating.wait(30) == -signal.SIGKILL
        finally:
            migrating.kill()
            migrating.wait(30)
        # Its server session, waiting for a lock it would wait 600 s for and holding
        # what the migration took so far (0014 alters jobs first), checks its client
        # every second while a statement runs: it finds it gone and rolls back.
        wait_until(lambda: _waiting_for(conn, audit) == 0, timeout=30,
                   what="the killed run's backend to give up")
        assert migrate_module.current_version(conn, old_schema) == SCHEDULES - 1
        # The schema at the version the killed run reached takes the previous release's
        # writes, as every version does.
        conn.execute(sql.SQL("INSERT INTO {} (effect, key, payload, fingerprint) "
                             "VALUES ('email.send', 'between', '{{}}', 'f')").format(jobs))
        holder.rollback()
        assert outbox.migrate(conn, schema=old_schema) == list(
            range(SCHEDULES, latest_version() + 1))
        assert [r[0] for r in conn.execute(sql.SQL("SELECT key FROM {} ORDER BY key")
                                           .format(jobs))] == ["before", "between"]
        assert _index_valid(conn, old_schema, "jobs_fair") is True


@pytest.mark.parametrize("refused", [
    # what a server on a platform without the check answers (InvalidParameterValue)
    "SELECT set_config('client_connection_check_interval', '-1s', true)",
    # what a server without the setting answers (UndefinedObject)
    "SELECT set_config('client_connection_checks_interval', '1s', true)",
])
def test_a_server_that_refuses_the_client_check_is_migrated_without_it(
        dsn: str, old_schema: str, monkeypatch: pytest.MonkeyPatch, refused: str) -> None:
    monkeypatch.setattr(migrate_module, "_CLIENT_CHECK", refused)
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert outbox.migrate(conn, schema=old_schema) == list(
            range(GROUPS, latest_version() + 1))


def test_an_index_build_cut_short_is_built_again_by_the_next_run(
        dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(bind_schema("DROP INDEX {schema}.jobs_fair", schema).encode())
        for n in range(2):
            conn.execute(bind_schema(
                "INSERT INTO {schema}.jobs (effect, key, payload, fingerprint) "
                "VALUES ('email.send', %s, '{{}}', 'f')", schema), (f"k{n}",))
        # A concurrent build that fails (here: not unique) leaves an INVALID index behind,
        # as a build interrupted by a crash or a cancel does.
        with pytest.raises(psycopg.errors.UniqueViolation):
            conn.execute(bind_schema(
                "CREATE UNIQUE INDEX CONCURRENTLY jobs_fair ON {schema}.jobs (effect)",
                schema).encode())
        assert _index_valid(conn, schema, "jobs_fair") is False
        assert outbox.migrate(conn, schema=schema) == []
        assert _index_valid(conn, schema, "jobs_fair") is True
        definition = conn.execute(
            "SELECT indexdef FROM pg_indexes WHERE schemaname = %s AND indexname = 'jobs_fair'",
            (schema,)).fetchone()
        assert definition is not None and "claim_rank" in definition[0]


def test_a_migration_joined_to_a_transaction_builds_its_indexes_there(
        dsn: str, old_schema: str) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute("SELECT 1")  # opens a transaction: migrate joins it
        assert outbox.migrate(conn, schema=old_schema)[0] == GROUPS
        assert _index_valid(conn, old_schema, "jobs_fair") is True
        conn.rollback()
        assert _index_valid(conn, old_schema, "jobs_fair") is None


def test_only_index_builds_may_follow_the_after_commit_line() -> None:
    text = f"CREATE TABLE {{schema}}.t (a int);\n{AFTER_COMMIT}\nDROP TABLE {{schema}}.t;\n"
    with pytest.raises(SchemaError, match=r"0042_bad: only CREATE INDEX IF NOT EXISTS .*"
                                          r"found: DROP TABLE"):
        _parse(42, "bad", text)
    parsed = _parse(43, "good", f"SELECT 1;\n{AFTER_COMMIT}\n-- why\n"
                                "CREATE INDEX IF NOT EXISTS t_a ON {schema}.t (a);\n")
    assert [i.name for i in parsed.indexes] == ["t_a"]
    assert parsed.indexes[0].concurrently().startswith("CREATE INDEX CONCURRENTLY IF NOT EXISTS")


class Held(outbox.Effect):
    """Blocks in perform until released; says when it started."""

    name = "test.held"

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()

    def perform(self, job: outbox.Job) -> None:
        self.started.set()
        assert self.release.wait(60), "never released"


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_running_dispatcher_that_meets_a_newer_schema_finishes_its_jobs_and_stops(
        dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    claimer_module = importlib.import_module("outbox._dispatch.claimer")
    monkeypatch.setattr(claimer_module, "SCHEMA_CHECK_INTERVAL", 0.1)
    effect = Held()
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue("test.held", key="in-flight", payload={})
    raised: list[BaseException] = []

    def run() -> None:
        try:
            if kind == "sync":
                outbox.Dispatcher(dsn, [effect], schema=schema).run()
            else:
                import asyncio
                asyncio.run(outbox.AsyncDispatcher(dsn, [effect], schema=schema).run())
        except BaseException as exc:  # the assertion below says what it was
            raised.append(exc)

    running = threading.Thread(target=run)
    running.start()
    assert effect.started.wait(30)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("INSERT INTO {}.schema_migrations (version, name) VALUES (%s, 'x')")
                     .format(sql.Identifier(schema)), (latest_version() + 1,))
    effect.release.set()
    running.join(60)
    assert not running.is_alive(), "the dispatcher did not stop"
    assert len(raised) == 1 and isinstance(raised[0], SchemaError), raised
    assert f"migrated to version {latest_version() + 1}, newer than this code knows" in str(
        raised[0])
    with psycopg.connect(dsn, autocommit=True) as conn:
        done = job(conn, "in-flight", schema)
        assert done is not None and done["status"] == "done"


def test_migrate_on_an_idle_connection_not_in_autocommit_leaves_it_as_it_was(
        dsn: str, old_schema: str) -> None:
    with psycopg.connect(dsn) as conn:  # autocommit off, no transaction open yet
        assert outbox.migrate(conn, schema=old_schema)[0] == GROUPS
        assert conn.autocommit is False
        assert _index_valid(conn, old_schema, "jobs_fair") is True


def test_a_role_that_reads_the_jobs_may_read_the_group_pauses_once_migrated(
        dsn: str, old_schema: str) -> None:
    reader, other = f"reader_{uuid.uuid4().hex[:8]}", f"other_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        try:
            for role in (reader, other):
                conn.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("GRANT SELECT ON {}.jobs TO {}").format(
                sql.Identifier(old_schema), sql.Identifier(reader)))
            outbox.migrate(conn, schema=old_schema)
            allowed = conn.execute(
                "SELECT has_table_privilege(%s, %s, 'SELECT'), "
                "has_table_privilege(%s, %s, 'SELECT')",
                (reader, f'"{old_schema}".group_pauses',
                 other, f'"{old_schema}".group_pauses')).fetchone()
            assert allowed == (True, False)
        finally:
            for role in (reader, other):
                conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
                conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
