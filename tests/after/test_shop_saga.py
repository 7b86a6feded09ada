"""The example shop's delivery saga (``examples.shop.fulfilment``) against the fakes of
``effects.testing``: charge and reserve, then ship after both; on a failure for good,
the compensations as effects of their own, in reverse (release, then refund with the
charge's PaymentIntent from ``job.after_results``)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from sqlalchemy.orm import Session

from effects.testing import FakeEmailProvider, FakeStripe
from examples.shop import app, fulfilment
from outbox.testing import jobs, ledger

SKU = "mug"


@dataclass
class Shop:
    dsn: str
    stripe: FakeStripe
    env: dict[str, str]

    def order(self, address: str, payment_method: str = "pm_card_visa") -> int:
        engine = app.engine_for(self.dsn)
        try:
            with Session(engine) as session, session.begin():
                order = fulfilment.place_order_for_delivery(
                    session, customer="ada", email="ada@example.com", amount=1250, sku=SKU,
                    address=address, payment_method=payment_method)
                return order.id
        finally:
            engine.dispose()

    def dispatch(self) -> None:
        dispatcher = fulfilment.fulfilment_dispatcher(self.env)
        dispatcher.run_until_idle(timeout=60)

    def jobs(self) -> dict[str, dict[str, Any]]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            return jobs(conn)

    def ledger(self) -> dict[str, dict[str, Any]]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            return ledger(conn)

    def stock(self) -> int:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            row = conn.execute("SELECT available FROM shop_stock WHERE sku = %s",
                               (SKU,)).fetchone()
        assert row is not None
        return int(row[0])


@pytest.fixture
def shop(dsn: str) -> Iterator[Shop]:
    name = f"saga_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    shop_dsn = urlunsplit(urlsplit(dsn)._replace(path=f"/{name}"))
    try:
        with FakeStripe(api_key=app.FAKE_API_KEY) as stripe, \
                FakeEmailProvider(api_key=app.FAKE_API_KEY) as resend:
            fulfilment.setup_fulfilment(shop_dsn, {SKU: 5})
            env = {"OUTBOX_DATABASE_URL": shop_dsn, "SHOP_EMAIL_URL": resend.url,
                   "SHOP_STRIPE_URL": stripe.url, "SHOP_BACKOFF_BASE": "0.01",
                   "SHOP_BACKOFF_CAP": "0.05", "SHOP_LEASE": "10"}
            yield Shop(shop_dsn, stripe, env)
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


def test_an_order_ships_after_its_charge_and_reservation(shop: Shop) -> None:
    order = shop.order("1 Main Street")
    step = fulfilment.keys(order)
    assert shop.jobs()[step["ship"]]["after_waiting"] == 2  # waits for both

    shop.dispatch()

    found = shop.jobs()
    assert all(found[step[s]]["status"] == "done" for s in ("payment", "reserve", "ship"))
    assert step["release"] not in found and step["refund"] not in found
    assert shop.stock() == 4
    recorded = shop.ledger()
    assert recorded[step["ship"]]["recorded_at"] > max(
        recorded[step["payment"]]["recorded_at"], recorded[step["reserve"]]["recorded_at"])


def test_a_shipment_refused_for_good_is_compensated_in_reverse(shop: Shop) -> None:
    order = shop.order("Nowhere Island")

    shop.dispatch()

    step = fulfilment.keys(order)
    found, recorded = shop.jobs(), shop.ledger()
    assert found[step["ship"]]["status"] == "failed"
    assert "does not deliver" in found[step["ship"]]["last_error"]
    assert found[step["release"]]["status"] == found[step["refund"]]["status"] == "done"
    assert recorded[step["release"]]["recorded_at"] < recorded[step["refund"]]["recorded_at"]
    assert shop.stock() == 5  # reserved, then released
    intent = recorded[step["payment"]]["result"]["id"]
    [refund] = shop.stripe.refunds
    assert refund["payment_intent"] == intent
    assert shop.stripe.performed(step["refund"]) == 1  # the refund's own key, once


def test_a_declined_card_fails_the_shipment_and_releases_the_stock(shop: Shop) -> None:
    order = shop.order("1 Main Street", payment_method="pm_card_chargeDeclined")

    shop.dispatch()

    step = fulfilment.keys(order)
    found, recorded = shop.jobs(), shop.ledger()
    assert found[step["payment"]]["status"] == "failed"
    ship = found[step["ship"]]
    assert ship["status"] == "failed" and ship["attempts"] == 0  # never performed
    assert step["payment"] in ship["last_error"]
    assert shop.stock() == 5  # reserved, then released
    assert recorded[step["refund"]]["result"] == {
        "skipped": f"{step['payment']} charged nothing"}
    assert shop.stripe.refunds == []
