"""The shop as a web application (FastAPI): ``POST /orders``, ``GET /orders/{id}``,
``POST /webhooks/stripe``.

``POST /orders`` writes the order and enqueues its email and its charge through
``outbox.contrib.sqlalchemy`` in the request's one transaction. Dispatchers perform them
in one of two modes:

- separate processes (``outbox run examples.shop.worker:dispatcher``), the default;
- inside the application (``SHOP_DISPATCH=app``): an ``outbox.AsyncDispatcher`` runs on
  uvicorn's event loop for the application's lifetime; at shutdown (SIGTERM) it stops
  claiming, finishes what is in flight and hands back what had not started.

``POST /webhooks/stripe`` receives Stripe's events signed with ``STRIPE_WEBHOOK_SECRET``:
the signature is checked, the event id recorded in the outbox's inbox and a
``payment_intent.succeeded`` marks its order paid, all in one transaction, so a
redelivered event changes nothing.

Serve it with::

    OUTBOX_DATABASE_URL=postgresql://... uvicorn --factory examples.shop.web:create_app
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Request, status
from pydantic import BaseModel, Field
from sqlalchemy.orm import Session

import outbox
from effects.inbox import WebhookRejected, receive_stripe_event
from examples.shop import app as shop
from outbox.contrib.sqlalchemy import transaction as outbox_tx

# The inbox consumer name under which the shop records the Stripe events it handled.
STRIPE_CONSUMER = "shop.stripe"


class OrderIn(BaseModel):
    """An order as the client sends it."""

    customer: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_-]+$")
    email: str = Field(max_length=254, pattern=r"^[^@\s]+@[^@\s]+\.[^@\s]+$")
    amount: int = Field(gt=0, le=99_999_999, description="In the currency's minor unit.")
    currency: str = Field(default="eur", pattern=r"^[a-z]{3}$")
    payment_method: str = Field(default="pm_card_visa", min_length=1, max_length=255)


class EffectOut(BaseModel):
    """Where one of the order's effects stands."""

    key: str
    effect: str
    status: str
    attempts: int | None
    last_error: str | None
    result: dict[str, Any] | None


class OrderOut(BaseModel):
    """An order and its effects."""

    id: int
    customer: str
    email: str
    amount: int
    currency: str
    payment_method: str
    paid_at: datetime | None = Field(description="Set by Stripe's payment_intent.succeeded.")
    payment_intent: str | None
    effects: list[EffectOut]


class StripeEventOut(BaseModel):
    """The answer to Stripe: the event, whether it was new, and the order it paid."""

    event: str
    new: bool
    order: int | None = Field(description="The order marked paid; null for a repeat or "
                                          "an event that concerns no order of the shop.")


def _session(request: Request) -> Iterator[Session]:
    with Session(request.app.state.engine) as session:
        yield session


async def _raw_body(request: Request) -> bytes:
    # The signature covers the bytes exactly as sent: read them before anything parses.
    return await request.body()


Db = Annotated[Session, Depends(_session)]
RawBody = Annotated[bytes, Depends(_raw_body)]


def create_app(
    database_url: str | None = None, *, dispatch: bool | None = None,
    env: Mapping[str, str] = os.environ, stripe_webhook_secret: str | None = None,
) -> FastAPI:
    """The shop's ASGI application on ``database_url`` (default ``$OUTBOX_DATABASE_URL``).

    With ``dispatch`` (default: ``SHOP_DISPATCH=app`` in ``env``) the application runs
    its own ``outbox.AsyncDispatcher`` during its lifespan. ``stripe_webhook_secret``
    (default ``$STRIPE_WEBHOOK_SECRET``) is the signing secret of the Stripe webhook
    endpoint; without it ``POST /webhooks/stripe`` answers 503.
    """
    dsn = database_url or env["OUTBOX_DATABASE_URL"]
    if dispatch is None:
        dispatch = env.get("SHOP_DISPATCH", "processes") == "app"
    engine = shop.engine_for(dsn)
    webhook_secret = stripe_webhook_secret or env.get("STRIPE_WEBHOOK_SECRET")

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            if dispatch:
                dispatcher = outbox.AsyncDispatcher(
                    dsn, shop.build_effects(env), **shop.dispatcher_options(env))
                async with dispatcher:  # on exit: stop, finish or hand back, await
                    yield
            else:
                yield
        finally:
            engine.dispose()

    api = FastAPI(title="outbox example shop", lifespan=lifespan)
    api.state.engine = engine

    def render(s: Session, order: shop.Order) -> OrderOut:
        return OrderOut(id=order.id, customer=order.customer, email=order.email,
                        amount=order.amount, currency=order.currency,
                        payment_method=order.payment_method, paid_at=order.paid_at,
                        payment_intent=order.payment_intent,
                        effects=[EffectOut(**e) for e in shop.effect_states(s, order.id)])

    @api.post("/orders", status_code=status.HTTP_201_CREATED)
    def place_order(body: OrderIn, s: Db) -> OrderOut:
        """Place an order: the order and its two jobs commit together, or none does."""
        with s.begin():
            order = shop.place_order(s, **body.model_dump())
        return render(s, order)

    @api.get("/orders/{order_id}")
    def get_order(order_id: int, s: Db) -> OrderOut:
        """The order and where its email and its charge stand."""
        order = s.get(shop.Order, order_id)
        if order is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no order {order_id}")
        return render(s, order)

    @api.post("/webhooks/stripe", responses={400: {"description": "Not a valid signed "
                                                                  "Stripe event."}})
    def stripe_webhook(body: RawBody, request: Request, s: Db) -> StripeEventOut:
        """Stripe's events, each handled once: verified, recorded in the inbox and, for
        ``payment_intent.succeeded``, the order marked paid, in one transaction.

        A redelivery (same event id) answers 200 with ``new: false`` and changes
        nothing; a forged, stale or malformed request answers 400 and records nothing.
        """
        if webhook_secret is None:
            raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE,
                                "the Stripe webhook is not configured (STRIPE_WEBHOOK_SECRET)")
        with s.begin():
            with outbox_tx(s, schema=shop.OUTBOX_SCHEMA) as tx:
                try:
                    got = receive_stripe_event(tx, STRIPE_CONSUMER, body, request.headers,
                                               secret=webhook_secret)
                except WebhookRejected as exc:
                    raise HTTPException(status.HTTP_400_BAD_REQUEST, str(exc)) from exc
            paid = None
            if got.new and got.event["type"] == "payment_intent.succeeded":
                paid = shop.mark_paid(s, json.loads(body))  # verified JSON, as sent
        return StripeEventOut(event=got.message_id, new=got.new, order=paid)

    return api
