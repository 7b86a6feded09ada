"""The test kit's database half (``outbox.testing``): server, fixtures and readers."""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path

import psycopg
import pytest
from pydantic import BaseModel

import outbox
from outbox.testing import (
    NotEnqueued,
    audit,
    job,
    jobs,
    ledger,
    ledger_row,
    received,
    require_enqueued,
    start_server,
)

pytest_plugins = ["pytester"]

EMAIL = {"to": "ada@example.com", "subject": "Order 102", "tags": [{"name": "shop"}]}


class Email(BaseModel):
    to: str
    subject: str
    tags: list[dict[str, str]]


def _enqueue(dsn: str, schema: str, effect: str, key: str, payload: Mapping[str, object]) -> int:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        result = tx.enqueue(effect, key=key, payload=payload)
    assert result.job_id is not None
    return result.job_id


def test_readers_return_the_job_and_ledger_rows_by_key(dsn: str, schema: str) -> None:
    job_id = _enqueue(dsn, schema, "email.send", "email-102", EMAIL)
    _enqueue(dsn, schema, "payment.charge", "pay-102", {"amount": 100})

    found = job(dsn, "email-102", schema=schema)
    assert found is not None and found["id"] == job_id and found["status"] == "pending"
    assert job(dsn, "nope", schema=schema) is None
    assert list(jobs(dsn, schema)) == ["email-102", "pay-102"]
    assert list(jobs(dsn, schema, effect="payment.charge")) == ["pay-102"]
    assert jobs(dsn, schema, key="pay-102")["pay-102"]["payload"] == {"amount": 100}
    assert ledger(dsn, schema=schema) == {}
    assert ledger_row(dsn, "email-102", schema=schema) is None


def test_ledger_row_holds_the_result_once_the_effect_ran(dsn: str, schema: str) -> None:
    class Echo(outbox.Effect):
        name = "email.send"

        def perform(self, job: outbox.Job) -> dict[str, object]:
            return {"id": f"msg-{job.key}"}

    _enqueue(dsn, schema, "email.send", "email-102", EMAIL)
    outbox.Dispatcher(dsn, [Echo()], schema=schema).run_until_idle(timeout=30)

    row = ledger_row(dsn, "email-102", schema=schema)
    assert row is not None and row["result"] == {"id": "msg-email-102"}
    assert set(ledger(dsn, schema=schema)) == {"email-102"}


def test_audit_and_inbox_readers(dsn: str, schema: str) -> None:
    from click.testing import CliRunner

    from outbox.cli import main

    job_id = _enqueue(dsn, schema, "email.send", "email-102", EMAIL)
    with psycopg.connect(dsn) as conn:
        for message, first in (("evt-2", True), ("evt-1", True), ("evt-2", False)):
            with outbox.transaction(conn, schema=schema) as tx:
                assert tx.receive("billing", message) is first
    assert received(dsn, "billing", schema) == ["evt-2", "evt-1"]
    assert received(dsn, "shipping", schema) == []
    result = CliRunner().invoke(main, ["retry", str(job_id), "--dsn", dsn, "--schema", schema,
                                       "--actor", "ada"])
    assert result.exit_code == 1  # pending: nothing to retry, and audited as such
    [entry] = audit(dsn, schema)
    assert (entry["actor"], entry["action"], entry["job_id"], entry["affected"]) == (
        "ada", "retry", job_id, 0)
    assert audit(dsn, schema, actor="reconciler") == []


def test_readers_on_a_connection_see_its_uncommitted_jobs(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn) as conn:
        with outbox.transaction(conn, schema=schema) as tx:
            tx.enqueue("email.send", key="email-102", payload=EMAIL)
            assert require_enqueued(conn, "email.send", key="email-102", payload=EMAIL,
                                    schema=schema)["status"] == "pending"
            assert job(dsn, "email-102", schema=schema) is None  # not committed yet
        conn.rollback()


def test_require_enqueued_accepts_a_pydantic_payload(dsn: str, schema: str) -> None:
    _enqueue(dsn, schema, "email.send", "email-102", EMAIL)
    model = Email.model_validate(EMAIL)
    found = require_enqueued(dsn, "email.send", payload=model, schema=schema)
    assert found["key"] == "email-102"


def test_require_enqueued_names_the_fields_that_differ(dsn: str, schema: str) -> None:
    _enqueue(dsn, schema, "email.send", "email-102", EMAIL)
    expected = {"to": "bob@example.com", "tags": [{"name": "shop"}], "cc": "x@example.com"}
    with pytest.raises(NotEnqueued) as raised:
        require_enqueued(dsn, "email.send", key="email-102", payload=expected, schema=schema)
    message = str(raised.value)
    assert "payload['to'] expected 'bob@example.com', found 'ada@example.com'" in message
    assert "payload['cc'] missing" in message
    assert "payload['subject'] not expected (found 'Order 102')" in message
    assert "tags" not in message


def test_require_enqueued_says_what_the_key_holds_instead(dsn: str, schema: str) -> None:
    _enqueue(dsn, schema, "payment.charge", "pay-102", {"amount": 100})
    with pytest.raises(NotEnqueued, match=r"no 'email.send' job with key 'pay-102'.*"
                                          r"jobs there: payment.charge 'pay-102'"):
        require_enqueued(dsn, "email.send", key="pay-102", schema=schema)


def test_require_enqueued_on_an_empty_schema_says_so(dsn: str, schema: str) -> None:
    with pytest.raises(AssertionError, match="the schema has no jobs"):
        require_enqueued(dsn, "email.send", schema=schema)


def test_require_enqueued_without_a_key_refuses_to_guess(dsn: str, schema: str) -> None:
    _enqueue(dsn, schema, "email.send", "email-1", EMAIL)
    _enqueue(dsn, schema, "email.send", "email-2", EMAIL)
    with pytest.raises(NotEnqueued, match="2 'email.send' jobs match.*pass key="):
        require_enqueued(dsn, "email.send", payload=EMAIL, schema=schema)
    other = {**EMAIL, "subject": "Order 103"}
    _enqueue(dsn, schema, "email.send", "email-3", other)
    assert require_enqueued(dsn, "email.send", payload=other, schema=schema)["key"] == "email-3"


def test_a_server_on_a_given_directory_restarts_and_stops() -> None:
    data_dir = Path(tempfile.mkdtemp(prefix="outbox-testkit-")) / "data"
    server = start_server(data_dir)
    try:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            before = conn.info.backend_pid
        server.restart()
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            assert conn.info.backend_pid != before
            assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        server.stop()
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(server.dsn, connect_timeout=2)
    assert data_dir.exists()  # a directory the caller named is the caller's to remove


def test_the_fixtures_reach_a_users_suite_through_the_plugin(
    pytester: pytest.Pytester, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OUTBOX_TEST_DSN", dsn)
    pytester.makepyfile(test_user="""
        import psycopg
        import outbox
        from outbox.testing import require_enqueued

        def test_order(outbox_dsn, outbox_schema):
            with psycopg.connect(outbox_dsn) as conn:
                with outbox.transaction(conn, schema=outbox_schema) as tx:
                    tx.enqueue("email.send", key="k1", payload={"to": "a@example.com"})
                require_enqueued(conn, "email.send", key="k1",
                                 payload={"to": "a@example.com"}, schema=outbox_schema)

        def test_schema_is_fresh(outbox_dsn, outbox_schema):
            with psycopg.connect(outbox_dsn) as conn:
                assert outbox.testing.jobs(conn, outbox_schema) == {}
    """)
    before = _schemas(dsn)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    assert _schemas(dsn) == before  # each test's schema was dropped after it


def _schemas(dsn: str) -> set[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return {name for (name,) in conn.execute("SELECT nspname FROM pg_namespace")}
