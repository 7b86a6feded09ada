"""Delivery for the shop: a saga of effects that wait for each other (``after=[...]``).

An order for delivery is placed as any order (its confirmation email and its charge,
``payment-order-<id>``), plus the stock reservation (``reserve-order-<id>``) and the
shipment (``ship-order-<id>``), which waits for the charge and the reservation: it is
not due until both are done. If a step fails for good, the saga compensates with effects
of their own, keyed by the order, in reverse order of the steps:

- ``release-order-<id>`` releases the stock once the reservation is settled;
- ``refund-order-<id>`` refunds the charge once the charge and the release are settled,
  with the PaymentIntent the charge's ledger row holds (``job.after_results``).

The step that failed enqueues them from its ``on_failed`` hook, in its fenced failed
transaction (``compensate``); a compensation enqueued twice is written once (its key).
Both are enqueued with ``after_failed="run"``: a compensation whose step failed too
finds an ``outbox.FailedParent`` and does nothing (nothing reserved, nothing charged).
A shipment whose parent failed fails with it, never performed, its ``last_error``
naming the parent.

The warehouse and the carrier are modelled as tables of the shop's database, written
from the effects' own connections (as an HTTP call would be), idempotently by the job's
key: ``shop_stock`` (units per SKU) and ``shop_warehouse`` (what was done, per key).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import psycopg
from sqlalchemy import text
from sqlalchemy.orm import Session

import outbox
from effects.payments import RefundPayment
from outbox.contrib.sqlalchemy import transaction as outbox_tx

from .app import (
    FAKE_API_KEY,
    OUTBOX_SCHEMA,
    Order,
    build_effects,
    charge_failed,
    dispatcher_options,
    place_order,
    setup,
)

_DDL = """
CREATE TABLE IF NOT EXISTS shop_deliveries (
    order_id integer PRIMARY KEY, sku text NOT NULL, address text NOT NULL);
CREATE TABLE IF NOT EXISTS shop_stock (
    sku text PRIMARY KEY, available integer NOT NULL CHECK (available >= 0));
CREATE TABLE IF NOT EXISTS shop_warehouse (
    key text PRIMARY KEY, action text NOT NULL, order_id integer NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp());
"""


def keys(order_id: int) -> dict[str, str]:
    """The keys of an order's delivery saga, by step."""
    return {step: f"{step}-order-{order_id}"
            for step in ("payment", "reserve", "ship", "release", "refund")}


def setup_fulfilment(dsn: str, stock: Mapping[str, int] | None = None) -> None:
    """The shop's tables and the delivery's (idempotent); ``stock``: units per SKU."""
    setup(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(_DDL)
        for sku, units in (stock or {}).items():
            conn.execute("INSERT INTO shop_stock VALUES (%s, %s) ON CONFLICT (sku) DO "
                         "UPDATE SET available = EXCLUDED.available", (sku, units))


def place_order_for_delivery(session: Session, *, customer: str, email: str, amount: int,
                             sku: str, address: str, **options: Any) -> Order:
    """``place_order``, plus the reservation and the shipment after the charge and the
    reservation; all in the session's transaction (the caller commits)."""
    order = place_order(session, customer=customer, email=email, amount=amount, **options)
    session.execute(text("INSERT INTO shop_deliveries VALUES (:id, :sku, :address)"),
                    {"id": order.id, "sku": sku, "address": address})
    step = keys(order.id)
    with outbox_tx(session, schema=OUTBOX_SCHEMA) as tx:
        tx.enqueue("stock.reserve", key=step["reserve"], payload={"order": order.id, "sku": sku})
        tx.enqueue("shipping.ship", key=step["ship"],
                   payload={"order": order.id, "address": address},
                   after=[step["payment"], step["reserve"]])
    return order


def compensate(tx: outbox.HookTransaction, order_id: int) -> None:
    """The saga's compensations, in reverse order of its steps: the release once the
    reservation is settled, the refund once the charge and the release are. Enqueued by
    whichever step fails for good (twice is once: the keys)."""
    step = keys(order_id)
    tx.enqueue("stock.release", key=step["release"], payload={"order": order_id},
               after=[step["reserve"]], after_failed="run")
    tx.enqueue("shop.refund", key=step["refund"], payload={"order": order_id},
               after=[step["payment"], step["release"]], after_failed="run")


def charge_failed_for_delivery(tx: outbox.HookTransaction, job: outbox.Job,
                               error: BaseException) -> None:
    """The charge's ``on_failed``: the shop's own (the order marked, the declined email),
    and, for an order for delivery, the saga's compensations."""
    charge_failed(tx, job, error)
    order = int(job.payload["metadata"]["order_id"])
    if tx.execute("SELECT 1 FROM shop_deliveries WHERE order_id = %s", (order,)).fetchone():
        compensate(tx, order)


class _Warehouse(outbox.Effect):
    """An effect that writes to the warehouse tables from its own connection, once per
    job key (a repeat of the key is answered with what was done the first time)."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn

    def act(self, job: outbox.Job, action: str, stock: int = 0) -> dict[str, Any]:
        """Record ``action`` for the job's key and move ``stock`` units of the order's
        SKU, in one warehouse transaction; refuse for good when the stock runs out."""
        order = int(job.payload["order"])
        with psycopg.connect(self.dsn) as conn:
            first = conn.execute(
                "INSERT INTO shop_warehouse (key, action, order_id) VALUES (%s, %s, %s) "
                "ON CONFLICT (key) DO NOTHING RETURNING key", (job.key, action, order)
            ).fetchone()
            if first and stock:
                moved = conn.execute(
                    "UPDATE shop_stock s SET available = s.available + %s FROM shop_deliveries d "
                    "WHERE d.order_id = %s AND s.sku = d.sku AND s.available + %s >= 0 "
                    "RETURNING s.sku", (stock, order, stock)).fetchone()
                if moved is None:
                    conn.rollback()
                    raise outbox.Permanent(f"no stock left for order {order}")
        return {"action": action, "order": order}


class ReserveStock(_Warehouse):
    """``stock.reserve``: one unit of the order's SKU set aside."""

    name = "stock.reserve"

    def perform(self, job: outbox.Job) -> dict[str, Any]:
        return self.act(job, "reserved", stock=-1)

    def on_failed(self, tx: outbox.HookTransaction, job: outbox.Job,
                  error: BaseException) -> None:
        compensate(tx, int(job.payload["order"]))


class Ship(_Warehouse):
    """``shipping.ship``: the carrier takes the parcel, or refuses the address for good."""

    name = "shipping.ship"

    def perform(self, job: outbox.Job) -> dict[str, Any]:
        address = str(job.payload["address"])
        if address.lower().startswith("nowhere"):
            raise outbox.Permanent(f"the carrier does not deliver to {address!r}")
        return self.act(job, "shipped")

    def on_failed(self, tx: outbox.HookTransaction, job: outbox.Job,
                  error: BaseException) -> None:
        compensate(tx, int(job.payload["order"]))


class ReleaseStock(_Warehouse):
    """``stock.release``: the reserved unit back in stock; nothing if the reservation
    failed (its ``FailedParent`` in ``job.after_results``)."""

    name = "stock.release"

    def perform(self, job: outbox.Job) -> dict[str, Any]:
        [(reservation, reserved)] = job.after_results.items()
        if isinstance(reserved, outbox.FailedParent):
            return {"skipped": f"{reservation} reserved nothing"}
        return self.act(job, "released", stock=1)


class RefundCharge(outbox.Effect):
    """``shop.refund``: refunds the order's charge with Stripe (``RefundPayment``, the
    job's key as Stripe's idempotency key), naming the PaymentIntent the charge's ledger
    row holds; nothing if the charge failed."""

    name = "shop.refund"

    def __init__(self, refunds: RefundPayment) -> None:
        self.refunds = refunds

    def perform(self, job: outbox.Job) -> dict[str, Any]:
        charge_key = keys(int(job.payload["order"]))["payment"]
        charge = job.after_results[charge_key]
        if isinstance(charge, outbox.FailedParent):
            return {"skipped": f"{charge_key} charged nothing"}
        refund = dataclasses.replace(job, payload={
            "payment_intent": charge["id"],
            "metadata": {"order_id": str(job.payload["order"])}}, model=None)
        return self.refunds.perform(refund)

    def close(self) -> None:
        """Close the Stripe client."""
        self.refunds.close()


def build_fulfilment_effects(dsn: str, env: Mapping[str, str] = os.environ,
                             ) -> list[outbox.Effect]:
    """The shop's effects and the delivery's (the fakes unless the keys are set)."""
    stripe_key = env.get("STRIPE_API_KEY")
    refunds = (RefundPayment(api_key=stripe_key) if stripe_key else
               RefundPayment(api_key=FAKE_API_KEY, base_url=env["SHOP_STRIPE_URL"]))
    return [*build_effects(env), ReserveStock(dsn), Ship(dsn), ReleaseStock(dsn),
            RefundCharge(refunds)]


def fulfilment_dispatcher(env: Mapping[str, str] = os.environ) -> outbox.Dispatcher:
    """The shop's dispatcher with delivery, configured from the environment (for
    ``outbox run examples.shop.fulfilment:fulfilment_dispatcher``)."""
    dsn = env["OUTBOX_DATABASE_URL"]
    options = dispatcher_options(env)
    options["on_failed"] = {"payment.charge": charge_failed_for_delivery}
    return outbox.Dispatcher(dsn, build_fulfilment_effects(dsn, env), **options)
