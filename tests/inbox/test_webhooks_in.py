"""Incoming webhooks handled once, through a real FastAPI app served by uvicorn.

Standard Webhooks requests come from ``PostWebhook`` itself; Stripe events from
``FakeStripe.send_event``, signed as Stripe signs them and verified by the stripe library.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest
import uvicorn
from fastapi import FastAPI, Request, Response
from psycopg import sql

import outbox
from effects import ChargeCard, PostWebhook
from effects.inbox import (
    WebhookRejected,
    areceive_stripe_event,
    receive_stripe_event,
    receive_webhook,
)
from effects.testing import FakeStripe, stripe_signature
from tests.crash.support import wait_until

HOOK_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
OLD_SECRET = "whsec_b2xkLXNlY3JldC1vbGQtc2VjcmV0"
STRIPE_SECRET = "whsec_stripe_test_secret"

Conn = psycopg.Connection[tuple[Any, ...]]


def make_app(dsn: str, schema: str) -> FastAPI:
    app = FastAPI()
    orders = sql.SQL("INSERT INTO {}.paid (intent) VALUES (%s)").format(sql.Identifier(schema))
    events = sql.SQL("INSERT INTO {}.events (id, kind) VALUES (%s, %s)").format(
        sql.Identifier(schema))

    @app.post("/hooks/orders")
    async def orders_hook(request: Request) -> Response:
        body = await request.body()
        with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
            try:
                got = receive_webhook(tx, "orders", body, request.headers,
                                      secret=[HOOK_SECRET, OLD_SECRET])
            except WebhookRejected:
                return Response(status_code=400)
            if got.new:
                conn.execute(events, (got.message_id, got.event["event"]))
        return Response(status_code=200 if got.new else 208)

    @app.post("/hooks/stripe")
    async def stripe_hook(request: Request) -> Response:
        body = await request.body()
        with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
            try:
                got = receive_stripe_event(tx, "shop", body, request.headers,
                                           secret=STRIPE_SECRET)
            except WebhookRejected:
                return Response(status_code=400)
            if got.new and got.event.type == "payment_intent.succeeded":
                conn.execute(orders, (got.event.data.object["id"],))
        return Response(status_code=200)

    answered: list[int] = []

    @app.post("/hooks/stripe-answer-lost")
    async def stripe_hook_answer_lost(request: Request) -> Response:
        # Commits its work, then fails the first answer, as if the response were lost.
        await stripe_hook(request)
        answered.append(1)
        return Response(status_code=500 if len(answered) == 1 else 200)

    @app.post("/hooks/stripe-async")
    async def stripe_hook_async(request: Request) -> Response:
        body = await request.body()
        async with (
            await psycopg.AsyncConnection.connect(dsn) as conn,
            outbox.transaction(conn, schema=schema) as tx,
        ):
            try:
                got = await areceive_stripe_event(tx, "shop-async", body,
                                                  request.headers, secret=STRIPE_SECRET)
            except WebhookRejected:
                return Response(status_code=400)
            if got.new:
                await conn.execute(orders, (got.event.data.object["id"],))
        return Response(status_code=200)

    return app


class Served:
    """A uvicorn server for ``app`` on a free port of 127.0.0.1, in a thread."""

    def __init__(self, app: FastAPI) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, "uvicorn to start")

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture
def db(dsn: str, schema: str) -> Iterator[Conn]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE TABLE {}.paid (intent text)").format(sql.Identifier(schema)))
        conn.execute(sql.SQL("CREATE TABLE {}.events (id text, kind text)").format(
            sql.Identifier(schema)))
        yield conn


@pytest.fixture
def served(dsn: str, schema: str, db: Conn) -> Iterator[Served]:
    server = Served(make_app(dsn, schema))
    yield server
    server.stop()


def rows(db: Conn, schema: str, table: str) -> list[tuple[Any, ...]]:
    return db.execute(sql.SQL("SELECT * FROM {}.{} ORDER BY 1").format(
        sql.Identifier(schema), sql.Identifier(table))).fetchall()


def hook_job(key: str) -> outbox.Job:
    return outbox.Job(id=1, effect="webhook.post", key=key, attempt=1, claim_version=1,
                      payload={"event": "order.paid", "data": {"order": 102}})


# -- Standard Webhooks -----------------------------------------------------------------


def test_a_standard_webhook_is_handled_once_across_redeliveries(
    served: Served, db: Conn, schema: str
) -> None:
    with PostWebhook(served.url("/hooks/orders"), secret=HOOK_SECRET) as post:
        assert post.perform(hook_job("evt-order-102-paid")) == {"status": 200}
        assert post.perform(hook_job("evt-order-102-paid")) == {"status": 208}

    assert rows(db, schema, "events") == [("evt-order-102-paid", "order.paid")]
    assert rows(db, schema, "inbox")[0][:2] == ("orders", "evt-order-102-paid")


def test_a_sender_still_on_the_old_secret_is_accepted_during_a_rotation(
    served: Served, db: Conn, schema: str
) -> None:
    with PostWebhook(served.url("/hooks/orders"), secret=OLD_SECRET) as post:
        assert post.perform(hook_job("evt-1")) == {"status": 200}

    assert rows(db, schema, "events") == [("evt-1", "order.paid")]


@pytest.mark.parametrize("secret", ["whsec_d3Jvbmc=", None])
def test_a_forged_or_unsigned_webhook_is_refused_and_records_nothing(
    served: Served, db: Conn, schema: str, secret: str | None
) -> None:
    body = b'{"data":{},"event":"order.paid","id":"evt-forged"}'
    headers = {"webhook-id": "evt-forged", "webhook-timestamp": str(int(time.time()))}
    if secret is not None:
        with (
            PostWebhook(served.url("/hooks/orders"), secret=secret) as post,
            pytest.raises(outbox.Permanent, match="HTTP 400"),
        ):
            post.perform(hook_job("evt-forged"))
    else:
        assert httpx.post(served.url("/hooks/orders"), content=body,
                          headers=headers).status_code == 400

    assert rows(db, schema, "inbox") == []
    assert rows(db, schema, "events") == []


# -- Stripe ----------------------------------------------------------------------------


def test_each_stripe_event_is_handled_once_even_when_stripe_redelivers(
    served: Served, db: Conn, schema: str
) -> None:
    with FakeStripe(webhook_url=served.url("/hooks/stripe"),
                    webhook_secret=STRIPE_SECRET) as fake:
        intent = {"id": "pi_102", "object": "payment_intent", "status": "succeeded"}
        first = fake.send_event("payment_intent.succeeded", intent, event_id="evt_102")
        again = fake.send_event("payment_intent.succeeded", intent, event_id="evt_102")
        other = fake.send_event("payment_intent.succeeded", {**intent, "id": "pi_103"})

    assert (first.status_code, again.status_code, other.status_code) == (200, 200, 200)
    assert rows(db, schema, "paid") == [("pi_102",), ("pi_103",)]


def test_a_stripe_event_with_a_bad_signature_is_refused(
    served: Served, db: Conn, schema: str
) -> None:
    with FakeStripe(webhook_url=served.url("/hooks/stripe"),
                    webhook_secret="whsec_not_the_endpoints") as fake:
        response = fake.send_event("payment_intent.succeeded", {"id": "pi_1"})

    assert response.status_code == 400
    assert rows(db, schema, "inbox") == []


def test_a_stale_stripe_signature_is_refused(served: Served, db: Conn, schema: str) -> None:
    body = b'{"id": "evt_1", "object": "event", "type": "x", "data": {"object": {}}}'
    stale = stripe_signature(STRIPE_SECRET, body, timestamp=int(time.time()) - 3600)

    response = httpx.post(served.url("/hooks/stripe"), content=body,
                          headers={"Stripe-Signature": stale})

    assert response.status_code == 400
    assert rows(db, schema, "inbox") == []


def test_the_async_helper_records_once_on_an_async_transaction(
    served: Served, db: Conn, schema: str
) -> None:
    with FakeStripe(webhook_url=served.url("/hooks/stripe-async"),
                    webhook_secret=STRIPE_SECRET) as fake:
        first = fake.send_event("payment_intent.succeeded", {"id": "pi_9"}, event_id="evt_9")
        again = fake.send_event("payment_intent.succeeded", {"id": "pi_9"}, event_id="evt_9")

    assert (first.status_code, again.status_code) == (200, 200)
    assert rows(db, schema, "paid") == [("pi_9",)]


# -- FakeStripe announcing the charges it makes ----------------------------------------


def charge_job(key: str) -> outbox.Job:
    return outbox.Job(id=1, effect="payment.charge", key=key, attempt=1, claim_version=1,
                      payload={"amount": 2000, "currency": "eur", "customer": "cus_Ada",
                               "payment_method": "pm_card_visa"})


@pytest.mark.parametrize("path", ["/hooks/stripe", "/hooks/stripe-answer-lost"])
def test_a_charge_is_announced_by_webhook_and_handled_once(
    served: Served, db: Conn, schema: str, path: str
) -> None:
    with (
        FakeStripe(webhook_url=served.url(path), webhook_secret=STRIPE_SECRET) as fake,
        ChargeCard(api_key="sk_test_x", base_url=fake.url) as charge,
    ):
        result = charge.perform(charge_job("charge-order-102"))
        charge.perform(charge_job("charge-order-102"))  # a retry: replayed, not announced
        deliveries = 2 if path.endswith("answer-lost") else 1
        fake.wait_for_deliveries(deliveries)
        delivered = fake.delivered_events

    assert [status for _, _, status in delivered] == ([500, 200] if deliveries == 2 else [200])
    assert len({event_id for event_id, _, _ in delivered}) == 1  # a redelivery, same id
    assert rows(db, schema, "paid") == [(result["id"],)]
