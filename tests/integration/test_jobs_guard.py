"""The guards of a jobs row (migration 0021): one CHECK calling ``jobs_row_valid``, in
place of the twelve constraints it replaced. Every row written by any path is refused
exactly when one of the old constraints refused it, with SQLSTATE 23514 naming that
constraint and a detail saying what is wrong; a schema migrated from version 20 keeps its
jobs and is guarded the same."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

import outbox
from outbox.sql import bind_schema

INSERT = ("INSERT INTO {schema}.jobs (effect, key, payload, fingerprint%(columns)s) "
          "VALUES (%%s, %%s, '{{}}', 'f'%(values)s)")

# (constraint, extra columns, their values, what the detail says, the key): each a raw
# INSERT that tx.enqueue and <schema>.enqueue would never make.
REFUSED_INSERTS = [
    ("jobs_effect_check", "", "", "effect must not be empty"),  # the effect ''
    ("jobs_key_check", "", "", "key is 0 characters long", ""),
    ("jobs_key_check", "", "", "key is 256 characters long", "k" * 256),
    ("jobs_attempts_check", ", attempts", ", -1", "attempts is -1"),
    ("jobs_max_attempts_check", ", max_attempts", ", 0", "max_attempts is 0"),
    ("jobs_claim_version_check", ", claim_version", ", -2", "claim_version is -2"),
    ("jobs_status_valid", ", status", ", 'sent'", "status is 'sent'"),
    ("jobs_lease_iff_running", ", status", ", 'running'", "status is 'running', lease_until NULL"),
    ("jobs_lease_iff_running", ", lease_until, claimed_by", ", now(), 'w1'",
     "status is 'pending', lease_until set, claimed_by set"),
    ("jobs_reconcile_checks_check", ", reconcile_checks", ", -1", "reconcile_checks is -1"),
    ("jobs_group_key_length", ", group_key", ", ''", "group_key is 0 characters long"),
    ("jobs_group_key_length", ", group_key", ", repeat('g', 256)", "group_key is 256"),
    ("jobs_priority_range", ", priority", ", 1001", "priority is 1001"),
    ("jobs_priority_range", ", priority", ", -1001", "priority is -1001"),
    ("jobs_after_waiting", ", after_waiting", ", -1", "after_waiting is -1"),
    ("jobs_after_failed", ", after_failed", ", 'skip'", "after_failed is 'skip'"),
]
REFUSED_INSERTS = [case if len(case) == 5 else (*case, "refused") for case in REFUSED_INSERTS]


def _insert(conn: psycopg.Connection[Any], schema: str, key: str, columns: str = "",
            values: str = "", effect: str = "email.send") -> None:
    text = INSERT % {"columns": columns, "values": values}
    conn.execute(bind_schema(text, schema).encode(), (effect, key))


@pytest.mark.parametrize(("constraint", "columns", "values", "detail", "key"), REFUSED_INSERTS)
def test_a_raw_insert_the_old_constraints_refused_is_refused_under_their_name(
        schema: str, conn: psycopg.Connection[Any], constraint: str, columns: str, values: str,
        detail: str, key: str) -> None:
    with pytest.raises(psycopg.errors.CheckViolation) as refused:
        _insert(conn, schema, key, columns, values,
                "" if constraint == "jobs_effect_check" else "email.send")
    diag = refused.value.diag
    assert diag.constraint_name == constraint
    assert diag.table_name == "jobs"
    assert diag.message_primary == (
        f'new row for relation "jobs" violates check constraint "{constraint}"')
    assert diag.message_detail is not None and detail in diag.message_detail
    conn.rollback()
    assert conn.execute(bind_schema("SELECT count(*) FROM {schema}.jobs", schema).encode()
                        ).fetchone() == (0,)
    conn.rollback()


def test_rows_the_old_constraints_let_through_are_written(
        schema: str, conn: psycopg.Connection[Any]) -> None:
    _insert(conn, schema, "plain")
    _insert(conn, schema, "nulls", ", group_key, after_failed", ", NULL, NULL")
    conn.execute(bind_schema(
        "INSERT INTO {schema}.jobs (effect, key, payload, fingerprint, priority, group_key, "
        "max_attempts, after_failed, after_waiting) VALUES ('email.send', repeat('k', 255), "
        "'{{}}', 'f', -1000, repeat('g', 255), 1, 'run', 2)", schema).encode())
    _insert(conn, schema, "running", ", status, lease_until, claimed_by",
            ", 'running', now(), 'w1'")
    for status in ("done", "failed", "reconcile"):
        _insert(conn, schema, status, ", status", f", '{status}'")
    conn.commit()
    assert conn.execute(bind_schema("SELECT count(*) FROM {schema}.jobs", schema).encode()
                        ).fetchone() == (7,)
    conn.rollback()


def test_an_update_that_breaks_the_state_machine_is_refused(
        schema: str, conn: psycopg.Connection[Any]) -> None:
    _insert(conn, schema, "k1")
    conn.commit()
    update = "UPDATE {schema}.jobs SET %s WHERE key = 'k1'"
    for change, constraint in (("status = 'running'", "jobs_lease_iff_running"),
                               ("attempts = attempts - 1", "jobs_attempts_check"),
                               ("status = 'lost'", "jobs_status_valid"),
                               ("after_waiting = -1", "jobs_after_waiting")):
        with pytest.raises(psycopg.errors.CheckViolation) as refused:
            conn.execute(bind_schema(update % change, schema).encode())
        assert refused.value.diag.constraint_name == constraint
        conn.rollback()
    # The claim's own change, all three lease columns at once, is a valid row.
    conn.execute(bind_schema(update % (
        "status = 'running', lease_until = now(), claimed_by = 'w1', "
        "claim_version = claim_version + 1, attempts = attempts + 1"), schema).encode())
    conn.commit()


def test_a_session_search_path_cannot_put_its_own_operator_in_the_guard(
        dsn: str, schema: str) -> None:
    # A role that may create objects puts an always-true <> for text before pg_catalog:
    # the guard's body, planned in that session, still uses the built-in operator.
    shadow = f"shadow_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        ident = sql.Identifier(shadow)
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(ident))
        try:
            conn.execute(sql.SQL(
                "CREATE FUNCTION {}.always(a text, b text) RETURNS boolean "
                "LANGUAGE sql IMMUTABLE AS 'SELECT true'").format(ident))
            conn.execute(sql.SQL(
                "CREATE OPERATOR {}.<> (LEFTARG = text, RIGHTARG = text, "
                "FUNCTION = {}.always)").format(ident, ident))
            conn.execute(sql.SQL("SET search_path = {}, pg_catalog").format(ident))
            assert conn.execute("SELECT ''::text <> ''::text").fetchone() == (True,)
            with pytest.raises(psycopg.errors.CheckViolation) as refused:
                _insert(conn, schema, "shadowed", effect="")
            assert refused.value.diag.constraint_name == "jobs_effect_check"
        finally:
            conn.execute("RESET search_path")
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(ident))


@pytest.fixture
def schema_at_20(dsn: str) -> Iterator[str]:
    name = f"g20_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert outbox.migrate(conn, schema=name, target=20)[-1] == 20
    yield name
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


def _checks(conn: psycopg.Connection[Any], schema: str) -> set[str]:
    rows = conn.execute(
        "SELECT c.conname FROM pg_constraint c JOIN pg_class t ON t.oid = c.conrelid "
        "JOIN pg_namespace n ON n.oid = t.relnamespace "
        "WHERE n.nspname = %s AND t.relname = 'jobs' AND c.contype = 'c'", (schema,)).fetchall()
    return {str(name) for name, in rows}


def _seq_scans(conn: psycopg.Connection[Any], schema: str) -> int:
    """Sequential scans of the schema's jobs table so far, this session's included."""
    conn.execute("SELECT pg_stat_force_next_flush()")  # flushed when the session idles
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute("SELECT seq_scan FROM pg_stat_user_tables "
                       "WHERE schemaname = %s AND relname = 'jobs'", (schema,)).fetchone()
    assert row is not None
    return int(row[0])


def test_a_schema_at_version_20_keeps_its_jobs_and_is_guarded_the_same(
        dsn: str, schema_at_20: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        before = _checks(conn, schema_at_20)
        assert len(before) == 12 and "jobs_status_valid" in before
        _insert(conn, schema_at_20, "pending")
        _insert(conn, schema_at_20, "running", ", status, lease_until, claimed_by",
                ", 'running', now(), 'w1'")
        _insert(conn, schema_at_20, "done", ", status", ", 'done'")
        scans_before = _seq_scans(conn, schema_at_20)
        assert outbox.migrate(conn, schema=schema_at_20, target=21) == [21]
        # No scan of the table under the migration's lock: the check is added NOT VALID.
        assert _seq_scans(conn, schema_at_20) == scans_before
        assert _checks(conn, schema_at_20) == {"jobs_row_valid"}
        rows = conn.execute(bind_schema("SELECT key, status FROM {schema}.jobs ORDER BY id",
                                        schema_at_20).encode()).fetchall()
        assert rows == [("pending", "pending"), ("running", "running"), ("done", "done")]
        with pytest.raises(psycopg.errors.CheckViolation) as refused:
            _insert(conn, schema_at_20, "bad", ", status", ", 'running'")
        assert refused.value.diag.constraint_name == "jobs_lease_iff_running"
        with outbox.transaction(conn, schema=schema_at_20) as tx:
            created = tx.enqueue("email.send", key="after-21", payload={"to": "a"})
        assert created.created


def test_a_role_granted_only_the_tables_enqueues_and_is_guarded(dsn: str, schema: str) -> None:
    # The guard is a function the check calls as the writing role: PUBLIC may execute it,
    # so an application's role needs nothing beyond what it needed before 0021.
    app = f"app_{uuid.uuid4().hex[:8]}"
    names = {"schema": sql.Identifier(schema), "app": sql.Identifier(app)}
    with psycopg.connect(dsn, autocommit=True) as conn:
        try:
            conn.execute(sql.SQL("CREATE ROLE {app}").format(**names))
            conn.execute(sql.SQL("GRANT USAGE ON SCHEMA {schema} TO {app}").format(**names))
            conn.execute(sql.SQL(
                "GRANT SELECT, INSERT ON {schema}.jobs, {schema}.effect_results TO {app}"
            ).format(**names))
            conn.execute(sql.SQL("GRANT SELECT ON {schema}.awake TO {app}").format(**names))
            conn.execute(sql.SQL("SET ROLE {app}").format(**names))
            with outbox.transaction(conn, schema=schema) as tx:
                assert tx.enqueue("email.send", key="by-app", payload={"to": "a"}).created
            with pytest.raises(psycopg.errors.CheckViolation) as refused:
                _insert(conn, schema, "by-app-bad", ", max_attempts", ", 0")
            assert refused.value.diag.constraint_name == "jobs_max_attempts_check"
        finally:
            conn.execute("RESET ROLE")
            conn.execute(sql.SQL("DROP OWNED BY {app}").format(**names))
            conn.execute(sql.SQL("DROP ROLE {app}").format(**names))
