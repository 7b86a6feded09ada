"""The shop's domain: orders as SQLAlchemy models; placing one writes the order and
enqueues its confirmation email and its charge in one transaction, keyed
``email-order-<id>`` and ``payment-order-<id>``. Stripe's ``payment_intent.succeeded``
webhook marks the order paid (``mark_paid``), once per Stripe event.

The charge is a flow: its completion hooks run in the transaction that records it.
``charged`` stores the PaymentIntent on the order (status ``charged``) and enqueues the
receipt naming it (``email-receipt-<id>``); ``charge_failed`` marks the order
``payment_failed`` and enqueues the card-declined email (``email-declined-<id>``). A
charge whose answer was lost is settled by the dispatcher's reconciler from Stripe's
own records (``ChargeCard.reconcile``), and its hooks then run the same way.

It talks to the fake providers of ``effects.testing`` by default (their URLs in
``SHOP_EMAIL_URL`` / ``SHOP_STRIPE_URL``), and to the real Resend and Stripe when
``RESEND_API_KEY`` / ``STRIPE_API_KEY`` are set. The web application is in
``examples.shop.web``; run dispatchers for it with::

    OUTBOX_DATABASE_URL=postgresql://... outbox run examples.shop.worker:dispatcher
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import psycopg
from sqlalchemy import (
    CheckConstraint,
    Engine,
    Identity,
    String,
    create_engine,
    func,
    text,
    update,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import outbox
from effects.email import SendEmail
from effects.payments import ChargeCard
from outbox.contrib.sqlalchemy import transaction as outbox_tx

OUTBOX_SCHEMA = "outbox"
FAKE_API_KEY = "test_key_for_the_fakes"
SHOP_EMAIL_FROM = "Shop <orders@shop.example>"
_ORDER_ID = re.compile(r"[1-9][0-9]{0,8}")


class Base(DeclarativeBase):
    """The shop's models."""


class Order(Base):
    """An order: who pays how much with which payment method."""

    __tablename__ = "shop_orders"
    __table_args__ = (CheckConstraint("amount > 0", name="shop_orders_amount_positive"),)

    id: Mapped[int] = mapped_column(Identity(always=True), primary_key=True)
    customer: Mapped[str] = mapped_column(String)
    email: Mapped[str] = mapped_column(String)
    amount: Mapped[int]
    currency: Mapped[str] = mapped_column(String)
    payment_method: Mapped[str] = mapped_column(String)
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())
    # Set by Stripe's payment_intent.succeeded webhook: when, by which PaymentIntent and
    # which event (the event id is what a redelivery of the same event carries again).
    paid_at: Mapped[datetime | None] = mapped_column(default=None)
    payment_intent: Mapped[str | None] = mapped_column(String, default=None)
    payment_event: Mapped[str | None] = mapped_column(String, default=None)
    # Written by the charge's completion hooks, with the charge's own outcome:
    # placed -> charged (on_done) or payment_failed (on_failed).
    status: Mapped[str] = mapped_column(String, default="placed", server_default="placed")


def engine_for(dsn: str) -> Engine:
    """A SQLAlchemy engine on psycopg 3 for any libpq connection string (URI or key=value)."""
    return create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(dsn),
                         pool_size=10, max_overflow=10)


def setup(dsn: str) -> None:
    """Create the outbox schema and the shop's own table (idempotent)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        outbox.migrate(conn, schema=OUTBOX_SCHEMA)
    engine = engine_for(dsn)
    try:
        Base.metadata.create_all(engine)
    finally:
        engine.dispose()


def place_order(
    session: Session, *, customer: str, email: str, amount: int,
    currency: str = "eur", payment_method: str = "pm_card_visa",
) -> Order:
    """Add the order and enqueue its confirmation email and its charge, atomically.

    Runs in the session's transaction and leaves the commit to the caller: the jobs
    commit if and only if the order does. The keys name the business effect (this
    order's email, this order's charge), so however often the dispatcher retries, the
    provider acts once.
    """
    order = Order(customer=customer, email=email, amount=amount, currency=currency,
                  payment_method=payment_method)
    session.add(order)
    session.flush()  # the id comes from the database
    with outbox_tx(session, schema=OUTBOX_SCHEMA) as tx:
        tx.enqueue("email.send", key=f"email-order-{order.id}", payload={
            "from": SHOP_EMAIL_FROM,
            "to": email,
            "subject": f"Order {order.id} confirmed",
            "text": f"Thank you, {customer}. Your order {order.id} is confirmed.",
            "tags": [{"name": "order", "value": str(order.id)}],
        })
        tx.enqueue("payment.charge", key=f"payment-order-{order.id}", payload={
            "amount": amount,
            "currency": currency,
            "customer": f"cus_{customer}",
            "payment_method": payment_method,
            "description": f"Order {order.id}",
            "metadata": {"order_id": str(order.id)},
        })
    return order


def mark_paid(session: Session, event: Mapping[str, Any]) -> int | None:
    """Mark the order of a ``payment_intent.succeeded`` event (its JSON) paid; return its id.

    The order is the one the charge named in the PaymentIntent's metadata
    (``order_id``, as ``place_order`` enqueued it). Returns None, changing nothing, for a
    PaymentIntent that is not one of the shop's orders (no such metadata or no such
    order): another system may share the Stripe account. Runs in the session's
    transaction; the caller makes it happen once per event (``receive_stripe_event``).
    """
    intent = event["data"]["object"]
    order_id = str((intent.get("metadata") or {}).get("order_id", ""))
    if not _ORDER_ID.fullmatch(order_id):  # ours are what place_order wrote, an int4
        return None
    return session.execute(
        update(Order).where(Order.id == int(order_id))
        .values(paid_at=func.now(), payment_intent=intent["id"], payment_event=event["id"])
        .returning(Order.id)).scalar_one_or_none()


def _order_of(job: outbox.Job) -> int:
    """The order a charge job is for (``place_order`` put it in the metadata)."""
    return int(job.payload["metadata"]["order_id"])


def charged(tx: outbox.HookTransaction, job: outbox.Job, result: Any) -> None:
    """The charge's ``on_done``: in the transaction that records the charge, store its
    PaymentIntent on the order and enqueue the receipt naming it."""
    order = _order_of(job)
    row = tx.execute("UPDATE shop_orders SET status = 'charged', payment_intent = %s "
                     "WHERE id = %s RETURNING customer, email, amount, currency",
                     (result["id"], order)).fetchone()
    if row is None:
        return  # the order is gone; there is nobody to send a receipt to
    customer, email, amount, currency = row
    tx.enqueue("email.send", key=f"email-receipt-{order}", payload={
        "from": SHOP_EMAIL_FROM,
        "to": email,
        "subject": f"Receipt for order {order}",
        "text": (f"Thank you, {customer}. We charged {amount / 100:.2f} "
                 f"{currency.upper()} for order {order} (payment {result['id']})."),
        "tags": [{"name": "order", "value": str(order)}],
    })


def charge_failed(tx: outbox.HookTransaction, job: outbox.Job, error: BaseException) -> None:
    """The charge's ``on_failed``: mark the order ``payment_failed`` and enqueue the
    card-declined email, in the transaction that fails the charge."""
    order = _order_of(job)
    row = tx.execute("UPDATE shop_orders SET status = 'payment_failed' WHERE id = %s "
                     "RETURNING customer, email", (order,)).fetchone()
    if row is None:
        return
    customer, email = row
    tx.enqueue("email.send", key=f"email-declined-{order}", payload={
        "from": SHOP_EMAIL_FROM,
        "to": email,
        "subject": f"Order {order}: your card was declined",
        "text": f"Sorry, {customer}: the payment for order {order} did not go through.",
        "tags": [{"name": "order", "value": str(order)}],
    })


def effect_keys(order_id: int) -> list[str]:
    """The keys of every effect an order may have: its email, its charge, and the
    receipt or the declined email the charge's hooks enqueue."""
    return [f"email-order-{order_id}", f"payment-order-{order_id}",
            f"email-receipt-{order_id}", f"email-declined-{order_id}"]


def effect_states(session: Session, order_id: int) -> list[dict[str, Any]]:
    """Where the order's effects stand: one row per job (or ledger entry), by key."""
    rows = session.execute(text(
        f"SELECT k.key, coalesce(j.effect, r.effect), "
        f"coalesce(j.status, CASE WHEN r.key IS NOT NULL THEN 'done' END), "
        f"j.attempts, j.last_error, r.result "
        f"FROM unnest(CAST(:keys AS text[])) AS k(key) "
        f"LEFT JOIN {OUTBOX_SCHEMA}.jobs j ON j.key = k.key "
        f"LEFT JOIN {OUTBOX_SCHEMA}.effect_results r ON r.key = k.key "
        f"ORDER BY k.key"), {"keys": effect_keys(order_id)})
    return [
        {"key": key, "effect": effect, "status": status, "attempts": attempts,
         "last_error": error, "result": result}
        for key, effect, status, attempts, error, result in rows if status is not None
    ]


def build_effects(env: Mapping[str, str] = os.environ) -> list[outbox.Effect]:
    """The shop's effects: real providers when their keys are set, else the fakes."""
    resend_key = env.get("RESEND_API_KEY")
    stripe_key = env.get("STRIPE_API_KEY")
    timeout = float(env.get("SHOP_PROVIDER_TIMEOUT", "10"))
    email = (SendEmail(api_key=resend_key, timeout=timeout) if resend_key else
             SendEmail(api_key=FAKE_API_KEY, base_url=env["SHOP_EMAIL_URL"], timeout=timeout))
    window = env.get("SHOP_CHARGE_UNKNOWN_WINDOW")
    charge_class = ChargeCard if window is None else _charge_with_window(float(window))
    charge = (charge_class(api_key=stripe_key, timeout=timeout) if stripe_key else
              charge_class(api_key=FAKE_API_KEY, base_url=env["SHOP_STRIPE_URL"],
                           timeout=timeout))
    return [email, charge]


def _charge_with_window(seconds: float) -> type[ChargeCard]:
    """``ChargeCard`` whose unknown outcomes are retried for ``seconds`` (instead of
    Stripe's 24 hours) before the reconciler asks Stripe: the demo uses 0, so that every
    lost answer is settled by the reconciler."""

    class WindowedChargeCard(ChargeCard):
        unknown_outcome_window = seconds

    return WindowedChargeCard


def dispatcher_options(env: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The dispatcher settings of the shop, from the environment."""
    return {
        "schema": OUTBOX_SCHEMA,
        "concurrency": int(env.get("SHOP_CONCURRENCY", "8")),
        "lease": float(env.get("SHOP_LEASE", "30")),
        "backoff": outbox.Backoff(base=float(env.get("SHOP_BACKOFF_BASE", "1")),
                                  cap=float(env.get("SHOP_BACKOFF_CAP", "300"))),
        "on_done": {"payment.charge": charged},
        "on_failed": {"payment.charge": charge_failed},
        "reconcile_interval": float(env.get("SHOP_RECONCILE_INTERVAL", "60")),
        "unknown_outcome_window": float(env.get("SHOP_UNKNOWN_WINDOW", str(24 * 3600))),
    }


def dispatcher(env: Mapping[str, str] = os.environ) -> outbox.Dispatcher:
    """The shop's dispatcher, configured from the environment (for ``outbox run``)."""
    return outbox.Dispatcher(env["OUTBOX_DATABASE_URL"], build_effects(env),
                             **dispatcher_options(env))
