"""``outbox cancel`` and ``outbox resolve`` as an operator runs them: the installed command
in its own process, against real PostgreSQL. Each changes the job, writes one audit row
naming the command line, and wakes listening dispatchers; a second run is refused and
changes nothing."""

from __future__ import annotations

import subprocess
import sys
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

import outbox
from outbox.sql import notify_channel
from outbox.testing import audit, job, ledger_row

from ..limits.support import wait_until

OUTBOX = str(Path(sys.executable).with_name("outbox"))


def outbox_command(dsn: str, schema: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run the installed ``outbox`` command with ``args`` (command name first)."""
    return subprocess.run([OUTBOX, args[0], "--dsn", dsn, "--schema", schema, *args[1:]],
                          capture_output=True, text=True, timeout=60, check=False)


def enqueue(dsn: str, schema: str, key: str, **options: Any) -> int:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        result = tx.enqueue("noop", key=key, payload={}, **options)
    assert result.job_id is not None
    return result.job_id


def in_reconcile(dsn: str, schema: str, key: str) -> int:
    """A job left in reconcile: its outcome at the provider unknown."""
    job_id = enqueue(dsn, schema, key)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("UPDATE {}.jobs SET status = 'reconcile', attempts = 1, "
                             "last_error = 'Unknown: timed out after sending' WHERE id = %s")
                     .format(sql.Identifier(schema)), (job_id,))
    return job_id


def refused(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert result.stdout == "" and "Traceback" not in result.stderr
    [line] = result.stderr.splitlines()
    for fragment in fragments:
        assert fragment in line, line


class Performed(outbox.Effect):
    """Records the keys it performs; ``done`` is set at the first, for the test to await."""

    name = "noop"

    def __init__(self) -> None:
        self.done = threading.Event()
        self.keys: list[str] = []

    def perform(self, job: outbox.Job) -> None:
        self.keys.append(job.key)
        self.done.set()


def test_cancel_fails_a_pending_job_and_wakes_a_dispatcher_for_its_key_mate(
        dsn: str, schema: str) -> None:
    # The first job of the key is due in an hour; the second, due now, waits behind it.
    first = enqueue(dsn, schema, "refund-1", ordering_key="order-7",
                    run_at=datetime.now(UTC) + timedelta(hours=1))
    enqueue(dsn, schema, "refund-2", ordering_key="order-7")
    effect = Performed()
    # Polling once an hour: only the notification can wake it in time.
    dispatcher = outbox.Dispatcher(dsn, [effect], schema=schema, poll_interval=3600)
    runner = threading.Thread(target=dispatcher.run)
    runner.start()
    try:
        # Another process's LISTEN has no event to await: its session is seen idle in it.
        with psycopg.connect(dsn, autocommit=True) as conn:
            wait_until(lambda: conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE query ILIKE 'LISTEN%%' "
                "AND state = 'idle' AND query LIKE %s",
                (f"%{notify_channel(schema)}%",)).fetchone() != (0,),
                "the dispatcher to listen")
        assert not effect.done.is_set()
        result = outbox_command(dsn, schema, "cancel", str(first), "--actor", "ada")
        assert result.returncode == 0, result.stderr
        assert result.stdout == (f"job {first} (noop, key refund-1) is cancelled: failed, "
                                 "never performed\n")
        assert effect.done.wait(timeout=30), "the key-mate was not performed at once"
    finally:
        dispatcher.stop()
        runner.join()
    assert effect.keys == ["refund-2"]
    cancelled = job(dsn, "refund-1", schema)
    assert cancelled is not None and cancelled["attempts"] == 0
    assert (cancelled["status"], cancelled["last_error"]) == (
        "failed", "cancelled from the command line by ada")
    [entry] = audit(dsn, schema)
    assert (entry["actor"], entry["action"], entry["job_id"], entry["affected"]) == (
        "ada", "cancel", first, 1)
    assert entry["detail"] == {"via": "command line"}

    again = outbox_command(dsn, schema, "cancel", str(first), "--actor", "ada")
    refused(again, f"job {first} is failed; only pending or running jobs can be cancelled",
            "outbox retry applies")
    assert len(audit(dsn, schema)) == 1


def _listening(dsn: str, schema: str) -> psycopg.Connection[Any]:
    """A session listening on the channel dispatchers listen on."""
    conn = psycopg.connect(dsn, autocommit=True)
    conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(notify_channel(schema))))
    return conn


def _next_notification(conn: psycopg.Connection[Any]) -> str:
    for notification in conn.notifies(timeout=30, stop_after=1):
        return notification.payload
    raise AssertionError("no notification within 30 s")


def _mark(dsn: str, schema: str) -> None:
    """A notification of the test's own: what arrives before it was sent before it."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_notify(%s, 'marker')", (notify_channel(schema),))


def test_resolve_as_performed_records_the_ledger_row_and_wakes_dispatchers(
        dsn: str, schema: str) -> None:
    job_id = in_reconcile(dsn, schema, "charge-order-9")
    with _listening(dsn, schema) as listener:
        result = outbox_command(dsn, schema, "resolve", str(job_id), "--performed",
                                "--note", "ch_3PzX in the Stripe dashboard", "--actor", "ada")
        assert result.returncode == 0, result.stderr
        assert result.stdout == (f"job {job_id} (noop, key charge-order-9) is resolved as "
                                 "performed: done, its key never performed again\n")
        assert _next_notification(listener) == ""

        again = outbox_command(dsn, schema, "resolve", str(job_id), "--not-performed")
        refused(again, f"job {job_id} is done; only reconcile jobs can be resolved")
        _mark(dsn, schema)
        assert _next_notification(listener) == "marker", "the refusal notified"

    resolved = job(dsn, "charge-order-9", schema)
    assert resolved is not None and resolved["status"] == "done"
    recorded = ledger_row(dsn, "charge-order-9", schema)
    assert recorded is not None
    assert recorded["result"] == {"resolved_by": "ada", "note": "ch_3PzX in the Stripe dashboard"}
    [entry] = audit(dsn, schema)
    assert (entry["actor"], entry["action"], entry["job_id"], entry["affected"]) == (
        "ada", "resolve_done", job_id, 1)
    assert entry["detail"] == {"via": "command line", "note": "ch_3PzX in the Stripe dashboard"}


def test_resolve_as_not_performed_fails_the_job_without_a_ledger_row(
        dsn: str, schema: str) -> None:
    job_id = in_reconcile(dsn, schema, "charge-order-10")
    with _listening(dsn, schema) as listener:
        result = outbox_command(dsn, schema, "resolve", str(job_id), "--not-performed",
                                "--actor", "ada")
        assert result.returncode == 0, result.stderr
        assert "is resolved as not performed: failed" in result.stdout
        assert _next_notification(listener) == ""
    resolved = job(dsn, "charge-order-10", schema)
    assert resolved is not None and resolved["status"] == "failed"
    assert resolved["last_error"] == (
        "resolved as not performed by ada: Unknown: timed out after sending")
    assert ledger_row(dsn, "charge-order-10", schema) is None
    [entry] = audit(dsn, schema)
    assert (entry["action"], entry["affected"], entry["detail"]) == (
        "resolve_failed", 1, {"via": "command line"})

    again = outbox_command(dsn, schema, "resolve", str(job_id), "--not-performed")
    refused(again, f"job {job_id} is failed; only reconcile jobs can be resolved")
    assert len(audit(dsn, schema)) == 1
