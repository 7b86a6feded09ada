"""Bad input on the command line: a short error naming the problem, a non-zero exit status
and never a traceback."""

from __future__ import annotations

import uuid

import psycopg
import pytest
from click.testing import CliRunner, Result
from psycopg import sql

from outbox.cli import main
from outbox.testing import audit, job, ledger_row

from ._support import enqueue


def _run(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def _lines(result: Result) -> list[str]:
    return [line for line in result.output.splitlines() if line.strip()]


def _assert_one_line_error(result: Result, *fragments: str) -> None:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = _lines(result)
    assert len(lines) == 1, lines
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def _assert_usage_error(result: Result, *fragments: str) -> None:
    """click's usage error: status 2, the usage reminder, then exactly one error line,
    which holds every one of ``fragments``."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit)
    errors = [line for line in _lines(result) if line.startswith("Error:")]
    assert len(errors) == 1, result.output
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


def _unchanged(dsn: str, schema: str, key: str, status: str) -> None:
    found = job(dsn, key, schema)
    assert found is not None and found["status"] == status
    assert audit(dsn, schema) == []  # a refusal leaves no trace


def test_retry_with_a_job_id_that_is_not_a_number(dsn: str, schema: str) -> None:
    result = _run("retry", "abc", "--dsn", dsn, "--schema", schema)
    _assert_usage_error(result, "JOB_ID", "'abc' is not a valid integer")


@pytest.mark.parametrize("written", ["1_0", "\u0663", " 12 ", "+5", "0x1f"])
def test_a_job_id_python_would_read_as_another_number_is_refused(
        dsn: str, schema: str, written: str) -> None:
    # int() reads "1_0" as 10 and the Arabic-Indic digit three as 3: a typo named, and
    # cancelled, a real job. Only the digits 0 to 9 are a job id.
    for number in range(1, 13):
        enqueue(dsn, schema, f"job-{number}", {"n": number})
    for args in (["retry", written], ["cancel", written], ["resolve", written, "--performed"]):
        result = _run(*args, "--dsn", dsn, "--schema", schema)
        _assert_usage_error(result, "JOB_ID", "the digits 0 to 9 only")
    for number in range(1, 13):
        _unchanged(dsn, schema, f"job-{number}", "pending")


def test_retry_of_a_job_that_does_not_exist(dsn: str, schema: str) -> None:
    result = _run("retry", "999999", "--dsn", dsn, "--schema", schema)
    _assert_one_line_error(result, "no job 999999", schema)


def test_retry_of_a_job_id_beyond_bigint(dsn: str, schema: str) -> None:
    result = _run("retry", str(2**63), "--dsn", dsn, "--schema", schema)
    _assert_one_line_error(result, "out of range")


def test_retry_of_a_pending_job(dsn: str, schema: str) -> None:
    job_id = enqueue(dsn, schema, "still-pending", {"n": 1})
    result = _run("retry", str(job_id), "--dsn", dsn, "--schema", schema)
    _assert_one_line_error(result, f"job {job_id} is pending", "only failed or reconcile")


def _in_status(dsn: str, schema: str, key: str, status: str) -> int:
    """A job in ``status``; a running one holds a dispatcher's lease, as the schema requires."""
    job_id = enqueue(dsn, schema, key, {"n": 1})
    running = status == "running"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL(
            "UPDATE {}.jobs SET status = %s, claimed_by = %s, "
            "lease_until = CASE WHEN %s THEN now() + interval '1 hour' END WHERE id = %s"
        ).format(sql.Identifier(schema)),
            (status, "worker-1" if running else None, running, job_id))
    return job_id


def test_cancel_and_resolve_with_a_job_id_that_is_not_a_number(dsn: str, schema: str) -> None:
    for args in (["cancel", "7x"], ["resolve", "7x", "--performed"]):
        result = _run(*args, "--dsn", dsn, "--schema", schema)
        _assert_usage_error(result, "JOB_ID", "'7x' is not a valid integer")


def test_cancel_and_resolve_of_a_job_that_does_not_exist(dsn: str, schema: str) -> None:
    for args in (["cancel", "999999"], ["resolve", "999999", "--not-performed"]):
        result = _run(*args, "--dsn", dsn, "--schema", schema)
        _assert_one_line_error(result, "no job 999999", schema)
    assert audit(dsn, schema) == []


def test_cancel_of_a_running_job_tells_it_and_keeps_it_running(dsn: str,
                                                              schema: str) -> None:
    # A running job is not refused: its claim is asked to stop (its dispatcher records
    # what the perform did once told); the job stays running until then.
    job_id = _in_status(dsn, schema, "in-flight", "running")
    result = _run("cancel", str(job_id), "--dsn", dsn, "--schema", schema)
    assert result.exit_code == 0, result.output
    assert f"job {job_id}" in result.output and "told to stop" in result.output
    found = job(dsn, "in-flight", schema)
    assert found is not None and found["status"] == "running"
    assert found["cancel_version"] == found["claim_version"]
    assert len(audit(dsn, schema)) == 1  # audited like any other operator action


def test_cancel_of_a_reconcile_job_points_to_resolve(dsn: str, schema: str) -> None:
    job_id = _in_status(dsn, schema, "unsure", "reconcile")
    result = _run("cancel", str(job_id), "--dsn", dsn, "--schema", schema)
    _assert_one_line_error(result, f"job {job_id} is reconcile",
                           "only pending or running jobs can be cancelled", "outbox resolve")
    _unchanged(dsn, schema, "unsure", "reconcile")


def test_resolve_of_a_job_not_in_reconcile(dsn: str, schema: str) -> None:
    job_id = enqueue(dsn, schema, "not-yet-tried", {"n": 1})
    result = _run("resolve", str(job_id), "--performed", "--dsn", dsn, "--schema", schema)
    _assert_one_line_error(result, f"job {job_id} is pending",
                           "only reconcile jobs can be resolved", "outbox cancel applies")
    _unchanged(dsn, schema, "not-yet-tried", "pending")
    assert ledger_row(dsn, "not-yet-tried", schema) is None


def test_resolve_without_saying_what_was_found(dsn: str, schema: str) -> None:
    job_id = _in_status(dsn, schema, "unsure", "reconcile")
    result = _run("resolve", str(job_id), "--dsn", dsn, "--schema", schema)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    errors = [line for line in _lines(result) if line.startswith("Error:")]
    assert errors == ["Error: say what you found: --performed or --not-performed"]
    _unchanged(dsn, schema, "unsure", "reconcile")


def test_status_on_an_unmigrated_schema(dsn: str) -> None:
    result = _run("status", "--dsn", dsn, "--schema", f"never_{uuid.uuid4().hex[:8]}")
    _assert_one_line_error(result, "has no outbox tables", "outbox migrate")


def test_status_and_transitions_on_a_newer_schema(dsn: str, schema: str) -> None:
    table = sql.SQL("{}.schema_migrations").format(sql.Identifier(schema))
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("INSERT INTO {} VALUES (999, 'future')").format(table))
    for command, *extra in (["status"], ["retry", "1"], ["cancel", "1"],
                            ["resolve", "1", "--performed"]):
        result = _run(command, *extra, "--dsn", dsn, "--schema", schema)
        _assert_one_line_error(result, "version 999, newer than this code knows", "upgrade")


def test_migrate_with_an_invalid_schema_name(dsn: str) -> None:
    result = _run("migrate", "--dsn", dsn, "--schema", "s" * 64)
    _assert_one_line_error(result, "not a valid PostgreSQL identifier")
