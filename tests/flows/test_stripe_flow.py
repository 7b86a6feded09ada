"""Reconciliation end to end: the fake Stripe loses a fifth of the charge answers and the
dispatcher settles every order from Stripe's own records, charging none twice."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import psycopg
import pytest
from psycopg import sql

import outbox
from effects import ChargeCard
from effects.testing import FakeStripe
from outbox.testing import jobs, ledger

STRIPE_KEY = "sk_test_flows_0123456789"


def _charges(dsn: str, schema: str, orders: int) -> None:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue_many(outbox.NewJob("payment.charge", f"charge-order-{n}", {
            "amount": 1000 + n, "currency": "eur", "customer": f"cus_{n % 25}",
            "payment_method": "pm_card_visa", "metadata": {"order_id": str(n)},
        }) for n in range(orders))


@pytest.mark.parametrize(("flavour", "orders"), [("sync", 500), ("async", 100)])
def test_orders_with_a_fifth_of_stripe_answers_lost_are_each_charged_once(
    dsn: str, schema: str, flavour: str, orders: int,
) -> None:
    with FakeStripe(api_key=STRIPE_KEY) as fake, \
            ChargeCard(STRIPE_KEY, base_url=fake.url, timeout=10.0) as card:
        fake.lose_responses(0.2, seed=18)
        _charges(dsn, schema, orders)
        options: dict[str, Any] = {"schema": schema, "unknown_outcome_window": 0,
                                   "reconcile_interval": 1.0, "concurrency": 16,
                                   "backoff": outbox.Backoff(base=0.01, cap=0.05)}
        for _ in range(20):  # a pass of claims, then the reconciler's pass, and so on
            if flavour == "sync":
                outbox.Dispatcher(dsn, [card], **options).run_until_idle(timeout=120)
            else:
                asyncio.run(outbox.AsyncDispatcher(dsn, [card], **options)
                            .run_until_idle(timeout=120))
            with psycopg.connect(dsn, autocommit=True) as conn:
                statuses = Counter(j["status"] for j in jobs(conn, schema).values())
            if statuses == {"done": orders}:
                break
        assert statuses == {"done": orders}

        lost = fake.lost_responses
        assert 0.1 * orders < len(lost) < 0.3 * orders  # about a fifth, by the seed
        intents: dict[str, list[str]] = {}
        for intent in fake.payment_intents:
            intents.setdefault(intent["metadata"]["outbox_key"], []).append(intent["id"])
        keys = [f"charge-order-{n}" for n in range(orders)]
        assert all(len(intents[key]) == 1 for key in keys)  # charged exactly once each
        assert all(fake.performed(key) == 1 for key in keys)
        with psycopg.connect(dsn, autocommit=True) as conn:
            recorded = ledger(conn, schema)
            decisions = conn.execute(sql.SQL(
                "SELECT a.detail->>'decision', j.key FROM {}.dashboard_audit a"
                " JOIN {}.jobs j ON j.id = a.job_id WHERE a.actor = 'reconciler'").format(
                    sql.Identifier(schema), sql.Identifier(schema))).fetchall()
        assert {key: recorded[key]["result"]["id"] for key in keys} == {
            key: intents[key][0] for key in keys}
        # Every lost answer was found performed by the reconciler (so was any answer that
        # came too late for the client under load). A request that failed before Stripe
        # executed it (a reset under load) is rightly found not performed, and then
        # performed once under its key.
        assert set(lost) <= {key for decision, key in decisions if decision == "performed"}
        assert {decision for decision, _ in decisions} <= {"performed", "not_performed"}
        assert len(decisions) == len({key for _, key in decisions})
