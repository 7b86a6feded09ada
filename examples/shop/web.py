"""The shop as a web application (FastAPI): ``POST /orders``, ``GET /orders/{id}``.

``POST /orders`` writes the order and enqueues its email and its charge through
``outbox.contrib.sqlalchemy`` in the request's one transaction. Dispatchers perform them
in one of two modes:

- separate processes (``outbox run examples.shop.worker:dispatcher``), the default;
- inside the application (``SHOP_DISPATCH=app``): an ``outbox.AsyncDispatcher`` runs on
  uvicorn's event loop for the application's lifetime; at shutdown (SIGTERM) it stops
  claiming, finishes what is in flight and hands back what had not started.

Serve it with::

    OUTBOX_DATABASE_URL=postgresql://... uvicorn --factory examples.shop.web:create_app
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Request, status
from pydantic import BaseModel, Field
from sqlalchemy.orm import Session

import outbox
from examples.shop import app as shop


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
    effects: list[EffectOut]


def _session(request: Request) -> Iterator[Session]:
    with Session(request.app.state.engine) as session:
        yield session


Db = Annotated[Session, Depends(_session)]


def create_app(
    database_url: str | None = None, *, dispatch: bool | None = None,
    env: Mapping[str, str] = os.environ,
) -> FastAPI:
    """The shop's ASGI application on ``database_url`` (default ``$OUTBOX_DATABASE_URL``).

    With ``dispatch`` (default: ``SHOP_DISPATCH=app`` in ``env``) the application runs
    its own ``outbox.AsyncDispatcher`` during its lifespan.
    """
    dsn = database_url or env["OUTBOX_DATABASE_URL"]
    if dispatch is None:
        dispatch = env.get("SHOP_DISPATCH", "processes") == "app"
    engine = shop.engine_for(dsn)

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
                        payment_method=order.payment_method,
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

    return api
