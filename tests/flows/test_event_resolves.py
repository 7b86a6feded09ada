"""A Stripe event naming a job's key (``metadata.outbox_key``) resolves the job as
performed through ``effects.inbox``: the next claim records the event's answer, runs
``on_done`` and calls no provider."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import psycopg
import pytest

import outbox
from effects.inbox import areceive_stripe_event, receive_stripe_event
from effects.testing._stripe import stripe_signature
from outbox.testing import jobs, ledger

SECRET = "whsec_flows_test"


class Charge(outbox.Effect):
    name = "payment.charge"

    def __init__(self) -> None:
        self.performed: list[str] = []
        self.done: list[tuple[str, Any]] = []

    def perform(self, job: outbox.Job) -> dict[str, Any]:
        self.performed.append(job.key)
        raise outbox.UnknownOutcome("the answer was lost")

    def on_done(self, tx: outbox.HookTransaction, job: outbox.Job, result: Any) -> None:
        self.done.append((job.key, result))


def _event(key: str, event_id: str = "evt_1", kind: str = "payment_intent.succeeded",
           ) -> tuple[bytes, dict[str, str]]:
    body = json.dumps({"id": event_id, "object": "event", "type": kind,
                       "created": int(time.time()), "data": {"object": {
                           "id": "pi_123", "object": "payment_intent", "status": "succeeded",
                           "amount": 2000, "currency": "eur",
                           "metadata": {"outbox_key": key, "order_id": "7"}}}}).encode()
    return body, {"Stripe-Signature": stripe_signature(SECRET, body)}


def _in_reconcile(dsn: str, schema: str, effect: Charge) -> None:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue("payment.charge", key="charge-order-7", payload={"order": 7})
    outbox.Dispatcher(dsn, [effect], schema=schema, unknown_outcome_window=0).run_until_idle()


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_stripe_event_naming_the_key_resolves_the_job(
    dsn: str, schema: str, flavour: str,
) -> None:
    effect = Charge()
    _in_reconcile(dsn, schema, effect)
    body, headers = _event("charge-order-7")
    if flavour == "sync":
        with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
            got = receive_stripe_event(tx, "shop", body, headers, secret=SECRET)
            again = receive_stripe_event(tx, "shop", body, headers, secret=SECRET)
    else:
        async def receive() -> tuple[Any, Any]:
            async with await psycopg.AsyncConnection.connect(dsn) as conn, \
                    outbox.transaction(conn, schema=schema) as tx:
                first = await areceive_stripe_event(tx, "shop", body, headers, secret=SECRET)
                second = await areceive_stripe_event(tx, "shop", body, headers, secret=SECRET)
            return first, second

        got, again = asyncio.run(receive())
    with psycopg.connect(dsn, autocommit=True) as conn:
        job = jobs(conn, schema)["charge-order-7"]
    assert (got.new, got.resolved_job) == (True, job["id"])
    assert (again.new, again.resolved_job) == (False, None)
    assert job["status"] == "pending" and job["performed_result"]["id"] == "pi_123"

    outbox.Dispatcher(dsn, [effect], schema=schema).run_until_idle()
    expected = {"id": "pi_123", "status": "succeeded", "amount": 2000, "currency": "eur"}
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert jobs(conn, schema)["charge-order-7"]["status"] == "done"
        assert ledger(conn, schema)["charge-order-7"]["result"] == expected
        audit = conn.execute(psycopg.sql.SQL(
            "SELECT actor, detail FROM {}.dashboard_audit").format(
                psycopg.sql.Identifier(schema))).fetchall()
    assert effect.performed == ["charge-order-7"]  # once: the first, lost, attempt
    assert effect.done == [("charge-order-7", expected)]
    assert audit == [("reconciler", {"decision": "performed", "source": "stripe event evt_1"})]


def test_events_that_name_no_waiting_job_change_nothing(dsn: str, schema: str) -> None:
    effect = Charge()
    _in_reconcile(dsn, schema, effect)
    cases = [_event("charge-order-8", "evt_2"),  # no such job
             _event("charge-order-7", "evt_3", kind="payment_intent.payment_failed")]
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        for body, headers in cases:
            got = receive_stripe_event(tx, "shop", body, headers, secret=SECRET)
            assert (got.new, got.resolved_job) == (True, None)
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert jobs(conn, schema)["charge-order-7"]["status"] == "reconcile"
