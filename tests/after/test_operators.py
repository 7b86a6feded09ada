"""What operators see and do with jobs that wait on parents: ``outbox status``, the
database metrics and the dashboard count them apart from due jobs (no false alert), the
dashboard shows a job's parents and children; a cancel or a person's resolution of a
parent settles its children; a parent in reconcile keeps them waiting."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator

import httpx
import psycopg
import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

import outbox
from outbox.cli import main
from outbox.metrics import render_database_metrics
from outbox.web import create_app

from .support import job_row


class Notified(outbox.Effect):
    name = "order.notified"

    def perform(self, job: outbox.Job) -> None:
        raise AssertionError(f"{job.key} performed while its parent is unsettled")


def _setup(dsn: str, schema: str) -> None:
    """A parent (email) pending and due, a child (its own effect) waiting on it."""
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue("email.send", key="email-1", payload={})
        tx.enqueue("order.notified", key="notified-1", payload={}, after=["email-1"])


def _operate(dsn: str, schema: str, *args: str) -> str:
    """An operator's command (``outbox retry``, ``cancel``, ``resolve``); its output."""
    result = CliRunner().invoke(main, [args[0], "--dsn", dsn, "--schema", schema,
                                       "--actor", "ops@example.com", *args[1:]])
    assert result.exit_code == 0, result.output
    return result.output


def test_status_and_metrics_count_waiting_jobs_apart_from_due_ones(
        dsn: str, schema: str) -> None:
    _setup(dsn, schema)
    result = CliRunner().invoke(main, ["status", "--dsn", dsn, "--schema", schema, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["due_backlog"] == 1 and report["waiting_on_parents"] == 1
    child = report["backlog_by_effect"]["order.notified"]
    assert (child["pending"], child["due"], child["waiting_on_parents"]) == (1, 0, 1)
    assert child["oldest_due_age_seconds"] is None
    text = CliRunner().invoke(main, ["status", "--dsn", dsn, "--schema", schema]).output
    assert "waiting on parents: 1" in text

    body, _ = render_database_metrics(dsn, schema)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(body.decode())
               for s in family.samples}
    effect = (("effect", "order.notified"),)
    assert samples[("outbox_waiting_jobs", effect)] == 1
    assert samples[("outbox_oldest_due_job_age_seconds", effect)] == 0
    assert samples[("outbox_waiting_jobs", (("effect", "email.send"),))] == 0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def client(dsn: str, schema: str) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(dsn, schema=schema)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://testserver") as opened:
        yield opened
    await app.state.outbox.close()


@pytest.mark.anyio
async def test_the_dashboard_shows_parents_children_and_what_a_job_waits_on(
        client: httpx.AsyncClient, dsn: str, schema: str) -> None:
    _setup(dsn, schema)
    parent, child = job_row(dsn, schema, "email-1"), job_row(dsn, schema, "notified-1")

    page = (await client.get(f"/jobs/{child['id']}")).text
    assert "waiting on 1 parent(s)" in page and "9999" not in page
    assert "<h3>Parents</h3>" in page and "email-1" in page and "waited on" in page

    page = (await client.get(f"/jobs/{parent['id']}")).text
    assert "Children (jobs waiting on this one)" in page and "notified-1" in page
    assert "to come" in page

    overview = (await client.get("/")).text
    assert re.search(r'<span class="n">1</span><span class="label">pending, waiting on '
                     r'parents</span>', overview)


def test_cancelling_a_parent_fails_its_waiting_children(dsn: str, schema: str) -> None:
    _setup(dsn, schema)
    parent = job_row(dsn, schema, "email-1")
    _operate(dsn, schema, "cancel", str(parent["id"]))
    child = job_row(dsn, schema, "notified-1")
    assert child["status"] == "failed"
    assert "parent email-1 failed for good" in child["last_error"]
    assert "cancelled from the command line" in child["last_error"]


@pytest.mark.parametrize(("performed", "child_status"), [(True, "pending"), (False, "failed")])
def test_a_parent_in_reconcile_keeps_children_waiting_until_a_person_decides(
        dsn: str, schema: str, performed: bool, child_status: str) -> None:
    _setup(dsn, schema)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"""UPDATE "{schema}".jobs SET status = 'reconcile', attempts = 1
                         WHERE key = 'email-1'""")
    # A dispatcher of the child's effect runs (its sweep too) and leaves it waiting.
    stats = outbox.Dispatcher(dsn, effects=[Notified()], schema=schema).run_until_idle(
        timeout=30)
    assert stats.done == 0
    assert job_row(dsn, schema, "notified-1")["after_waiting"] == 1
    parent = job_row(dsn, schema, "email-1")
    _operate(dsn, schema, "resolve", str(parent["id"]),
             "--performed" if performed else "--not-performed")
    child = job_row(dsn, schema, "notified-1")
    assert (child["status"], child["after_waiting"]) == (child_status, 0)
    if performed:  # due now
        with psycopg.connect(dsn, autocommit=True) as conn:
            assert conn.execute("SELECT now() >= %s", (child["available_at"],)).fetchone() \
                == (True,)


def test_retrying_a_child_failed_with_its_parent_runs_it_at_once(dsn: str, schema: str) -> None:
    """An operator's retry of a parent does not revive its failed children; retrying the
    child itself runs it at once, with no parent left to wait for."""
    _setup(dsn, schema)
    parent, child = job_row(dsn, schema, "email-1"), job_row(dsn, schema, "notified-1")
    _operate(dsn, schema, "cancel", str(parent["id"]))
    _operate(dsn, schema, "retry", str(parent["id"]))
    assert job_row(dsn, schema, "email-1")["status"] == "pending"
    assert job_row(dsn, schema, "notified-1")["status"] == "failed"  # not revived
    _operate(dsn, schema, "retry", str(child["id"]))
    retried = job_row(dsn, schema, "notified-1")
    assert (retried["status"], retried["after_waiting"]) == ("pending", 0)
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.execute("SELECT now() >= %s", (retried["available_at"],)).fetchone() \
            == (True,)
