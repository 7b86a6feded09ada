"""``outbox trigger-sql``: the printed trigger, run on a business table, enqueues with the
row's own transaction, and a dispatcher performs each job once."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from psycopg import sql

import outbox
from outbox.cli import main
from outbox.testing import jobs

from .support import Recorder

# A table name that needs quoting: capitals and a space.
TABLE = "Paid Orders"


def trigger_sql(schema: str, *options: str) -> str:
    result = CliRunner().invoke(main, ["trigger-sql", "--schema", schema,
                                       "--table", f"{schema}.{TABLE}", *options])
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture
def orders(dsn: str, schema: str) -> Iterator[sql.Composed]:
    """The business table, with the trigger `outbox trigger-sql` printed for it."""
    table = sql.SQL("{}.{}").format(sql.Identifier(schema), sql.Identifier(TABLE))
    printed = trigger_sql(schema, "--effect", "test.record",
                          "--key", "'order-paid-' || NEW.id",
                          "--payload", "jsonb_build_object('order', NEW.id, 'total', NEW.total)")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE TABLE {} (id int PRIMARY KEY, total numeric NOT NULL,"
                             " note text)").format(table))
        conn.execute(printed.encode())
    yield table


def _write(dsn: str, statement: sql.Composed, *, commit: bool = True) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute(statement)
        if commit:
            conn.commit()
        else:
            conn.rollback()


def test_the_job_commits_with_its_row_and_is_performed_once(
        dsn: str, schema: str, orders: sql.Composed) -> None:
    _write(dsn, sql.SQL("INSERT INTO {} VALUES (1, 19.99)").format(orders))
    _write(dsn, sql.SQL("INSERT INTO {} VALUES (2, 5)").format(orders), commit=False)
    assert {key: job["payload"] for key, job in jobs(dsn, schema).items()} == {
        "order-paid-1": {"order": 1, "total": 19.99}}

    # The same row written again (same key, same payload): no second job.
    _write(dsn, sql.SQL("UPDATE {} SET note = 'gift wrap' WHERE id = 1").format(orders))
    assert list(jobs(dsn, schema)) == ["order-paid-1"]

    recorder = Recorder()
    dispatcher = outbox.Dispatcher(dsn, [recorder], schema=schema)
    dispatcher.run_until_idle(timeout=30)
    # After it was performed, the ledger still holds the key: a write again enqueues nothing.
    _write(dsn, sql.SQL("UPDATE {} SET note = 'again' WHERE id = 1").format(orders))
    dispatcher.run_until_idle(timeout=30)
    assert recorder.calls == {"order-paid-1": 1}
    assert jobs(dsn, schema)["order-paid-1"]["status"] == "done"


def test_a_changed_payload_under_the_same_key_fails_the_write(
        dsn: str, schema: str, orders: sql.Composed) -> None:
    _write(dsn, sql.SQL("INSERT INTO {} VALUES (1, 10)").format(orders))
    with pytest.raises(psycopg.Error) as raised:
        _write(dsn, sql.SQL("UPDATE {} SET total = 11 WHERE id = 1").format(orders))
    assert raised.value.diag.sqlstate == "OB409"
    assert "with a different payload" in str(raised.value)
    assert [job["payload"] for job in jobs(dsn, schema).values()] == [{"order": 1, "total": 10}]


def test_a_payload_that_is_not_an_object_is_refused_with_the_row(
        dsn: str, schema: str) -> None:
    table = sql.SQL("{}.{}").format(sql.Identifier(schema), sql.Identifier(TABLE))
    printed = trigger_sql(schema, "--effect", "test.record", "--key", "'k-' || NEW.id",
                          "--payload", "to_jsonb(NEW.id)", "--on", "insert")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE TABLE {} (id int PRIMARY KEY)").format(table))
        conn.execute(printed.encode())
        with pytest.raises(psycopg.Error, match="payload must be a JSON object, got a JSON "
                                                "number") as raised:
            conn.execute(sql.SQL("INSERT INTO {} VALUES (7)").format(table))
        assert raised.value.diag.sqlstate == "OB422"
        assert conn.execute(sql.SQL("SELECT count(*) FROM {}").format(table)).fetchone() == (0,)
    assert jobs(dsn, schema) == {}


def test_only_rows_the_condition_holds_for_enqueue(dsn: str, schema: str) -> None:
    table = sql.SQL("{}.{}").format(sql.Identifier(schema), sql.Identifier(TABLE))
    printed = trigger_sql(schema, "--effect", "test.record",
                          "--key", "'shipped-' || NEW.id || '-v' || NEW.version",
                          "--payload", "jsonb_build_object('order', NEW.id)",
                          "--when", "NEW.status = 'shipped'", "--name", "notify shipped")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE TABLE {} (id int PRIMARY KEY, status text,"
                             " version int)").format(table))
        conn.execute(printed.encode())
        conn.execute(sql.SQL("INSERT INTO {} VALUES (1, 'new', 1), (2, 'shipped', 1)")
                     .format(table))
        conn.execute(sql.SQL("UPDATE {} SET status = 'shipped', version = 2 WHERE id = 1")
                     .format(table))
    assert sorted(jobs(dsn, schema)) == ["shipped-1-v2", "shipped-2-v1"]


@pytest.mark.parametrize(("options", "words"), [
    (["--effect", " ", "--key", "NEW.id"], "effect must be a non-empty effect name"),
    (["--effect", "e", "--key", " "], "the key expression must not be empty"),
    (["--effect", "e", "--key", "NEW.id", "--payload", "$outbox_enqueue$"],
     "must not contain $outbox_enqueue$"),
    (["--effect", "e", "--key", "NEW.id", "--name", "n" * 64], "is not a PostgreSQL identifier"),
])
def test_bad_options_are_refused_naming_them(options: list[str], words: str) -> None:
    result = CliRunner().invoke(main, ["trigger-sql", "--table", "orders", *options])
    assert result.exit_code == 2
    assert words in result.output


def test_the_printed_sql_quotes_identifiers() -> None:
    result = CliRunner().invoke(main, ["trigger-sql", "--table", 'we"ird.Order Lines',
                                       "--schema", "My Outbox", "--effect", "it's.done",
                                       "--key", "NEW.id::text"])
    assert result.exit_code == 0, result.output
    text: Any = result.output
    assert 'ON "we""ird"."Order Lines"' in text
    assert "PERFORM \"My Outbox\".enqueue(\n        'it''s.done'," in text
