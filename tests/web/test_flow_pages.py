"""The job page shows a job's place in its flow and the reconciler's decisions."""

from __future__ import annotations

import re
from typing import Any

import httpx
import psycopg
import pytest

import outbox
from outbox.testing import jobs

pytestmark = pytest.mark.anyio


class Charge(outbox.Effect):
    """Acts, loses its answer the first time (window 0: reconcile), and is found."""

    name = "payment.charge"

    def __init__(self) -> None:
        self.acted: set[str] = set()

    def perform(self, job: outbox.Job) -> dict[str, Any]:
        first = job.key not in self.acted
        self.acted.add(job.key)
        if first:
            raise outbox.UnknownOutcome("answer lost")
        return {"id": "pi_1"}

    def reconcile(self, job: outbox.Job) -> outbox.Performed | None:
        return outbox.Performed({"id": "pi_1"}) if job.key in self.acted else None

    def on_done(self, tx: outbox.HookTransaction, job: outbox.Job, result: Any) -> None:
        tx.enqueue("email.send", key=f"receipt-{job.key}", payload={"intent": result["id"]})


class Email(outbox.Effect):
    name = "email.send"

    def perform(self, job: outbox.Job) -> None:
        return None


async def test_job_page_shows_follow_ups_parent_and_reconciliation(
        client: httpx.AsyncClient, dsn: str, schema: str) -> None:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue("payment.charge", key="charge-order-1", payload={})
    options: dict[str, Any] = {"schema": schema, "unknown_outcome_window": 0}
    charge = Charge()
    outbox.Dispatcher(dsn, [charge, Email()], **options).run_until_idle(timeout=30)
    with psycopg.connect(dsn, autocommit=True) as conn:
        waiting = jobs(conn, schema)["charge-order-1"]
    assert waiting["status"] == "reconcile"
    page = (await client.get(f"/jobs/{waiting['id']}")).text
    assert "Asked at the reconciler's next pass" in page
    assert "No decision by the reconciler" in page

    outbox.Dispatcher(dsn, [charge, Email()], **options).run_until_idle(timeout=30)
    with psycopg.connect(dsn, autocommit=True) as conn:
        found = jobs(conn, schema)
    parent, child = found["charge-order-1"], found["receipt-charge-order-1"]
    assert (parent["status"], child["status"]) == ("done", "done")
    page = (await client.get(f"/jobs/{parent['id']}")).text
    assert re.search(rf'href="[^"]*/jobs/{child["id"]}"', page)
    assert "receipt-charge-order-1" in page
    assert re.search(r"<td>performed</td><td>asked the provider</td>", page)
    child_page = (await client.get(f"/jobs/{child['id']}")).text
    assert re.search(rf'href="[^"]*/jobs/{parent["id"]}">charge-order-1</a> \(done\)',
                     child_page)
