"""The ``outbox`` command line against real PostgreSQL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import psycopg
import pytest
from click.testing import CliRunner
from psycopg import sql

import outbox
from outbox.cli import main
from outbox.testing import jobs

from .helpers import wait_until


def test_migrate_creates_then_reports_up_to_date(dsn: str) -> None:
    schema = f"cli_{uuid.uuid4().hex[:8]}"
    try:
        first = CliRunner().invoke(main, ["migrate", "--dsn", dsn, "--schema", schema])
        assert first.exit_code == 0, first.output
        assert "applied 0001, 0002" in first.output
        again = CliRunner().invoke(main, ["migrate", "--schema", schema],
                                   env={"OUTBOX_DATABASE_URL": dsn})
        assert again.exit_code == 0 and "up to date" in again.output
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def _failed_job(dsn: str, schema: str) -> int:
    with psycopg.connect(dsn) as conn:
        with outbox.transaction(conn, schema=schema) as tx:
            job_id = tx.enqueue("email.send", key="email-order-7", payload={"to": "x"}).job_id
        conn.execute(f"UPDATE \"{schema}\".jobs SET status = 'failed', attempts = 25, "
                     "last_error = 'Permanent: 422 validation_error'")
        conn.commit()
    assert job_id is not None
    return job_id


def test_status_shows_counts_and_recent_failures(dsn: str, schema: str) -> None:
    _failed_job(dsn, schema)
    result = CliRunner().invoke(main, ["status", "--dsn", dsn, "--schema", schema, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["jobs"] == {"pending": 0, "running": 0, "done": 0, "failed": 1, "reconcile": 0}
    assert report["recent_failures"][0]["key"] == "email-order-7"
    assert report["recent_failures"][0]["last_error"] == "Permanent: 422 validation_error"
    table = CliRunner().invoke(main, ["status", "--dsn", dsn, "--schema", schema])
    assert "failed" in table.output and "email-order-7" in table.output


def test_status_shows_the_busiest_groups_of_each_effect(dsn: str, schema: str) -> None:
    sizes = {"acme": 30, "beta": 12, None: 9, "delta": 7, "echo": 5, "fox": 4, "golf": 1}
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue_many([outbox.NewJob("email.send", key=f"{group}-{n}", payload={},
                                       group=group)
                         for group, size in sizes.items() for n in range(size)])
        tx.enqueue("sms.send", key="sms-1", payload={})
    result = CliRunner().invoke(main, ["status", "--dsn", dsn, "--schema", schema, "--json"])
    assert result.exit_code == 0, result.output
    busiest = json.loads(result.output)["busiest_groups"]
    assert busiest == {
        "email.send": [{"group": "acme", "pending": 30}, {"group": "beta", "pending": 12},
                       {"group": None, "pending": 9}, {"group": "delta", "pending": 7},
                       {"group": "echo", "pending": 5}],
        "sms.send": [{"group": None, "pending": 1}]}
    table = CliRunner().invoke(main, ["status", "--dsn", dsn, "--schema", schema]).output
    assert "busiest groups (top 5 by pending jobs):" in table
    assert "acme 30, beta 12, (no group) 9, delta 7, echo 5" in table
    assert "sms.send" not in table.split("busiest groups")[1], "an effect without groups"


def test_status_on_a_large_table_estimates_done_jobs_as_the_dashboard_does(
        dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch) -> None:
    table = sql.Identifier(schema, "jobs")
    with psycopg.connect(dsn, autocommit=True) as conn:
        with outbox.transaction(conn, schema=schema) as tx:
            tx.enqueue_many([outbox.NewJob("email.send", f"k{i}", {}) for i in range(5)])
        conn.execute(sql.SQL("UPDATE {} SET status = 'done' WHERE key <> 'k0'").format(table))
        conn.execute(sql.SQL("ANALYZE {}").format(table))  # the planner's estimate: 5 rows
        with outbox.transaction(conn, schema=schema) as tx:  # done jobs it does not know
            tx.enqueue_many([outbox.NewJob("email.send", f"n{i}", {}) for i in range(20)])
        conn.execute(sql.SQL("UPDATE {} SET status = 'done' WHERE key LIKE 'n%%'").format(table))
    # Past a cap of 3 jobs a status is estimated (a block sample, here of every page:
    # the planner's estimate of 5 rows is small), never counted with a scan of every row.
    monkeypatch.setattr("outbox._queue.COUNT_CAP", 3)
    result = CliRunner().invoke(main, ["status", "--dsn", dsn, "--schema", schema, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["jobs"] == {"pending": 1, "running": 0, "done": 24, "failed": 0, "reconcile": 0}
    assert report["backlog_by_effect"]["email.send"]["due"] == 1


def test_retry_sends_a_failed_job_back_to_pending(dsn: str, schema: str) -> None:
    job_id = _failed_job(dsn, schema)
    result = CliRunner().invoke(main, ["retry", str(job_id), "--dsn", dsn, "--schema", schema])
    assert result.exit_code == 0, result.output
    job = jobs(dsn, schema)["email-order-7"]
    assert (job["status"], job["attempts"]) == ("pending", 0)
    refused = CliRunner().invoke(main, ["retry", str(job_id), "--dsn", dsn, "--schema", schema])
    assert refused.exit_code == 1
    assert "is pending; only failed or reconcile jobs can be retried" in refused.output
    missing = CliRunner().invoke(main, ["retry", "999999", "--dsn", dsn, "--schema", schema])
    assert missing.exit_code == 1 and "no job 999999" in missing.output


def test_errors_are_one_line_without_traceback(dsn: str) -> None:
    result = CliRunner().invoke(main, ["status", "--dsn", dsn, "--schema", "nope_not_here"])
    assert result.exit_code == 1
    assert result.output.strip().count("\n") == 0
    assert "has no outbox tables" in result.output
    assert "Traceback" not in result.output
    bad = CliRunner().invoke(main, ["status", "--dsn", "postgresql://nobody@/x?host=/nonexistent"])
    assert bad.exit_code == 1 and "Traceback" not in bad.output
    no_dsn = CliRunner().invoke(main, ["status"], env={"OUTBOX_DATABASE_URL": None})
    assert no_dsn.exit_code == 2 and "--dsn" in no_dsn.output


@pytest.mark.parametrize("kind", ["Dispatcher", "AsyncDispatcher"])
def test_run_loads_module_attribute_and_stops_on_sigterm(
        dsn: str, schema: str, tmp_path: Path, kind: str) -> None:
    (tmp_path / "shopapp.py").write_text(textwrap.dedent(f"""
        import outbox

        class Noop(outbox.Effect):
            name = "noop"
            def perform(self, job):
                return {{"ok": job.key}}

        dispatcher = outbox.{kind}({dsn!r}, [Noop()], schema={schema!r})
    """))
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue("noop", key="k", payload={})
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "outbox.cli", "run", "shopapp:dispatcher"],
                            cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: jobs(dsn, schema)["k"]["status"] == "done", what="job done")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert json.loads(err.strip().splitlines()[-1])["done"] == 1


def test_run_with_a_bad_target_is_one_line(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["run", "no_such_module_xyz:dispatcher"])
    assert result.exit_code == 1
    assert "No module named 'no_such_module_xyz'" in result.output
