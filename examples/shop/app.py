"""The shop: placing an order writes the order and enqueues its email and its charge in one
transaction, keyed ``email-order-<id>`` and ``payment-order-<id>``.

It talks to the fake providers of ``effects.testing`` by default (their URLs in
``SHOP_EMAIL_URL`` / ``SHOP_STRIPE_URL``), and to the real Resend and Stripe when
``RESEND_API_KEY`` / ``STRIPE_API_KEY`` are set. Run a dispatcher for it with::

    OUTBOX_DATABASE_URL=postgresql://... outbox run examples.shop.app:dispatcher
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import psycopg

import outbox
from effects.email import SendEmail
from effects.payments import ChargeCard

OUTBOX_SCHEMA = "outbox"
FAKE_API_KEY = "test_key_for_the_fakes"
SHOP_EMAIL_FROM = "Shop <orders@shop.example>"

ORDERS_TABLE = """
CREATE TABLE IF NOT EXISTS shop_orders (
    id             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    customer       text    NOT NULL,
    email          text    NOT NULL,
    amount         integer NOT NULL CHECK (amount > 0),
    currency       text    NOT NULL,
    payment_method text    NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT now()
)
"""


def setup(conn: psycopg.Connection[Any]) -> None:
    """Create the outbox schema and the shop's own table (idempotent)."""
    outbox.migrate(conn, schema=OUTBOX_SCHEMA)
    with conn.transaction():
        conn.execute(ORDERS_TABLE)


def place_order(
    conn: psycopg.Connection[Any], *, customer: str, email: str, amount: int,
    currency: str = "eur", payment_method: str = "pm_card_visa",
) -> int:
    """Write the order and enqueue its confirmation email and its charge, atomically.

    If anything here fails, neither the order nor its effects exist. The keys name the
    business effect (this order's email, this order's charge), so however often the
    dispatcher retries, the provider acts once.
    """
    with outbox.transaction(conn, schema=OUTBOX_SCHEMA) as tx:
        row = conn.execute(
            "INSERT INTO shop_orders (customer, email, amount, currency, payment_method) "
            "VALUES (%s, %s, %s, %s, %s) RETURNING id",
            (customer, email, amount, currency, payment_method),
        ).fetchone()
        assert row is not None
        order_id = int(row[0])
        tx.enqueue("email.send", key=f"email-order-{order_id}", payload={
            "from": SHOP_EMAIL_FROM,
            "to": email,
            "subject": f"Order {order_id} confirmed",
            "text": f"Thank you, {customer}. Your order {order_id} is confirmed.",
            "tags": [{"name": "order", "value": str(order_id)}],
        })
        tx.enqueue("payment.charge", key=f"payment-order-{order_id}", payload={
            "amount": amount,
            "currency": currency,
            "customer": f"cus_{customer}",
            "payment_method": payment_method,
            "description": f"Order {order_id}",
            "metadata": {"order_id": str(order_id)},
        })
    return order_id


def build_effects(env: Mapping[str, str] = os.environ) -> list[outbox.Effect]:
    """The shop's effects: real providers when their keys are set, else the fakes."""
    resend_key = env.get("RESEND_API_KEY")
    stripe_key = env.get("STRIPE_API_KEY")
    timeout = float(env.get("SHOP_PROVIDER_TIMEOUT", "10"))
    email = (SendEmail(api_key=resend_key, timeout=timeout) if resend_key else
             SendEmail(api_key=FAKE_API_KEY, base_url=env["SHOP_EMAIL_URL"], timeout=timeout))
    charge = (ChargeCard(api_key=stripe_key, timeout=timeout) if stripe_key else
              ChargeCard(api_key=FAKE_API_KEY, base_url=env["SHOP_STRIPE_URL"], timeout=timeout))
    return [email, charge]


def dispatcher(env: Mapping[str, str] = os.environ) -> outbox.Dispatcher:
    """The shop's dispatcher, configured from the environment (for ``outbox run``)."""
    return outbox.Dispatcher(
        env["OUTBOX_DATABASE_URL"], build_effects(env), schema=OUTBOX_SCHEMA,
        concurrency=int(env.get("SHOP_CONCURRENCY", "8")),
        lease=float(env.get("SHOP_LEASE", "30")),
        backoff=outbox.Backoff(base=float(env.get("SHOP_BACKOFF_BASE", "1")),
                               cap=float(env.get("SHOP_BACKOFF_CAP", "300"))),
    )
