"""The example shop: atomic orders through its HTTP interface, Stripe's webhook handled
once per event, and the demo's end-to-end "once" check."""

from __future__ import annotations

import os
import signal
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import psycopg
import pytest
import sqlalchemy.exc
from sqlalchemy.orm import Session

from effects.testing import FakeEmailProvider, FakeStripe
from examples.shop import app, demo
from examples.shop.web import STRIPE_CONSUMER
from outbox.testing import jobs, received

from ..integration.helpers import wait_until

WEBHOOK_SECRET = "whsec_shop_test_endpoint"


@pytest.fixture
def shop_dsn(dsn: str) -> Iterator[str]:
    """A database of its own: the shop and the demo own their tables there."""
    name = f"shop_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    parts = urlsplit(dsn)
    yield urlunsplit(parts._replace(path=f"/{name}"))
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


def _jobs(dsn: str) -> list[tuple[str, str]]:
    return sorted((key, job["effect"]) for key, job in jobs(dsn).items())


def _orders(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM shop_orders").fetchone()
    assert row is not None
    return int(row[0])


def test_an_order_and_its_two_effects_commit_together(shop_dsn: str) -> None:
    app.setup(shop_dsn)
    engine = app.engine_for(shop_dsn)
    try:
        with Session(engine) as session, session.begin():
            order_id = app.place_order(session, customer="ada", email="ada@example.com",
                                       amount=1250).id
        with pytest.raises(sqlalchemy.exc.IntegrityError, match="amount_positive"), \
                Session(engine) as session, session.begin():
            app.place_order(session, customer="bob", email="bob@example.com", amount=-1)
        with Session(engine) as session:  # rolled back by the caller: nothing stays
            app.place_order(session, customer="eve", email="eve@example.com", amount=5)
            session.rollback()
    finally:
        engine.dispose()
    assert _jobs(shop_dsn) == [(f"email-order-{order_id}", "email.send"),
                               (f"payment-order-{order_id}", "payment.charge")]
    assert _orders(shop_dsn) == 1


@pytest.fixture
def shop_url(shop_dsn: str, tmp_path: Path) -> Iterator[str]:
    """The shop's web application served by uvicorn in a process of its own."""
    app.setup(shop_dsn)
    env = {**os.environ, "OUTBOX_DATABASE_URL": shop_dsn,
           "STRIPE_WEBHOOK_SECRET": WEBHOOK_SECRET}
    server, url = demo.start_web(env, tmp_path / "web.log")
    yield url
    server.send_signal(signal.SIGTERM)
    # uvicorn shuts down gracefully, then re-raises the signal it caught.
    assert server.wait(timeout=30) in (0, -signal.SIGTERM)


def test_the_http_interface_places_and_shows_orders(shop_dsn: str, shop_url: str) -> None:
    with httpx.Client(base_url=shop_url) as client:
        placed = client.post("/orders", json={
            "customer": "ada", "email": "ada@example.com", "amount": 1250})
        assert placed.status_code == 201, placed.text
        order = placed.json()
        assert (order["customer"], order["amount"], order["currency"]) == ("ada", 1250, "eur")
        assert sorted((e["effect"], e["status"]) for e in order["effects"]) == [
            ("email.send", "pending"), ("payment.charge", "pending")]
        assert client.get(f"/orders/{order['id']}").json() == order
        assert client.get("/orders/999999").status_code == 404
        refused = client.post("/orders", json={
            "customer": "bob", "email": "not-an-address", "amount": 0})
        assert refused.status_code == 422
        where = {tuple(e["loc"]) for e in refused.json()["detail"]}
        assert where == {("body", "email"), ("body", "amount")}
    assert _orders(shop_dsn) == 1
    assert len(_jobs(shop_dsn)) == 2


def _paid(dsn: str) -> list[tuple[int, str | None, str | None, object]]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT id, payment_intent, payment_event, paid_at "
                            "FROM shop_orders ORDER BY id").fetchall()
    return [(int(i), pi, evt, at) for i, pi, evt, at in rows]


def _stripe_events_received(dsn: str) -> list[str]:
    return sorted(received(dsn, STRIPE_CONSUMER, app.OUTBOX_SCHEMA))


def _charge_orders(shop_dsn: str, stripe: FakeStripe, orders: int) -> None:
    """Place orders over HTTP and run a dispatcher until their charges are made."""
    with FakeEmailProvider() as email:
        env = {"OUTBOX_DATABASE_URL": shop_dsn, "SHOP_EMAIL_URL": email.url,
               "SHOP_STRIPE_URL": stripe.url}
        app.dispatcher(env).run_until_idle(timeout=60)
    assert len(stripe.charges) == orders


def test_stripe_webhook_marks_the_order_paid_once_however_often_delivered(
    shop_dsn: str, shop_url: str
) -> None:
    """The charge's payment_intent.succeeded event, sent by the fake Stripe to the
    shop's endpoint, marks the order paid; the same event again (as Stripe redelivers)
    and two copies at once change nothing and are answered 2xx."""
    with FakeStripe(webhook_url=f"{shop_url}/webhooks/stripe",
                    webhook_secret=WEBHOOK_SECRET) as stripe, \
            httpx.Client(base_url=shop_url) as client:
        for customer in ("ada", "bob"):
            client.post("/orders", json={"customer": customer, "amount": 1250,
                                         "email": f"{customer}@example.com"}
                        ).raise_for_status()
        _charge_orders(shop_dsn, stripe, 2)
        stripe.wait_for_deliveries(2)
        assert [status for _, _, status in stripe.delivered_events] == [200, 200]
        paid = _paid(shop_dsn)
        intents = {intent["metadata"]["order_id"]: intent for intent in stripe.charges}
        events = [event for event, _, _ in stripe.delivered_events]
        for order_id, intent_id, event_id, paid_at in paid:
            assert intent_id == intents[str(order_id)]["id"]
            assert event_id in events
            assert paid_at is not None
            shown = client.get(f"/orders/{order_id}").json()
            assert (shown["payment_intent"], shown["paid_at"] is not None) == (intent_id, True)
        assert _stripe_events_received(shop_dsn) == sorted(events)

        # Stripe redelivers the first order's event: answered 200, handled no more.
        order_id, intent_id, event_id, _ = paid[0]
        assert event_id is not None
        again = stripe.send_event("payment_intent.succeeded", intents[str(order_id)],
                                  event_id=event_id)
        assert again.status_code == 200, again.text
        assert again.json() == {"event": event_id, "new": False, "order": None}
        # Two copies of the second order's event at once: one handles it, one waits
        # for that transaction and finds it done.
        order_id, intent_id, event_id, _ = paid[1]
        answers: list[httpx.Response] = []
        copies = [threading.Thread(target=lambda: answers.append(stripe.send_event(
            "payment_intent.succeeded", intents[str(order_id)], event_id=event_id)))
            for _ in range(2)]
        for copy in copies:
            copy.start()
        for copy in copies:
            copy.join()
        assert [a.status_code for a in answers] == [200, 200]
        assert not any(a.json()["new"] for a in answers)
    assert _paid(shop_dsn) == paid  # paid_at untouched: no event was handled twice
    assert _stripe_events_received(shop_dsn) == sorted(events)


def test_a_forged_stripe_event_is_refused_and_records_nothing(
    shop_dsn: str, shop_url: str
) -> None:
    """A bad or missing signature answers 400 with the inbox and the order untouched; a
    genuine event about a PaymentIntent of no order of the shop is acknowledged only."""
    with httpx.Client(base_url=shop_url) as client:
        order = client.post("/orders", json={"customer": "eve", "amount": 990,
                                             "email": "eve@example.com"}).json()
    intent = {"id": "pi_forged", "object": "payment_intent", "amount": 990,
              "status": "succeeded", "metadata": {"order_id": str(order["id"])}}
    with FakeStripe(webhook_url=f"{shop_url}/webhooks/stripe",
                    webhook_secret="whsec_not_the_shops") as forger:
        forged = forger.send_event("payment_intent.succeeded", intent)
    assert forged.status_code == 400
    assert "Stripe-Signature" in forged.json()["detail"]
    unsigned = httpx.post(f"{shop_url}/webhooks/stripe", json={
        "id": "evt_unsigned", "type": "payment_intent.succeeded",
        "data": {"object": intent}})
    assert unsigned.status_code == 400
    assert WEBHOOK_SECRET not in forged.text + unsigned.text
    assert _stripe_events_received(shop_dsn) == []
    # Signed, but for a PaymentIntent of no order of the shop: acknowledged, pays nothing.
    with FakeStripe(webhook_url=f"{shop_url}/webhooks/stripe",
                    webhook_secret=WEBHOOK_SECRET) as stripe:
        foreign = stripe.send_event("payment_intent.succeeded", {
            **intent, "id": "pi_elsewhere", "metadata": {"order_id": "999999"}})
    assert foreign.status_code == 200, foreign.text
    assert foreign.json()["order"] is None
    assert [paid_at for *_, paid_at in _paid(shop_dsn)] == [None]


def test_the_demo_kills_a_worker_and_still_performs_everything_once(shop_dsn: str) -> None:
    assert demo.run_demo(shop_dsn, orders=80, seed=7) == 0


def test_sigterm_stops_the_lifespan_dispatcher_with_nothing_lost(
    shop_dsn: str, tmp_path: Path
) -> None:
    """uvicorn gets SIGTERM while its in-app dispatcher has both of its slots held in
    flight at the providers: what was performed is recorded done, what was not is handed
    back (pending, attempt refunded), nothing stays running; a dispatcher started
    afterwards completes the rest, each effect performed once."""
    app.setup(shop_dsn)
    with FakeEmailProvider() as email, FakeStripe() as stripe:
        env = {**os.environ, "OUTBOX_DATABASE_URL": shop_dsn, "SHOP_DISPATCH": "app",
               "SHOP_EMAIL_URL": email.url, "SHOP_STRIPE_URL": stripe.url,
               "SHOP_CONCURRENCY": "2", "SHOP_LEASE": "60"}
        holds = [email.hold_next(), stripe.hold_next()]
        log = tmp_path / "web.log"
        server, url = demo.start_web(env, log, log_level="info")
        with httpx.Client(base_url=url) as client:
            for n in range(10):
                client.post("/orders", json={
                    "customer": f"c{n}", "email": f"c{n}@example.com", "amount": 100 + n,
                }).raise_for_status()
        for hold in holds:
            hold.wait_for_arrival()
        server.send_signal(signal.SIGTERM)
        wait_until(lambda: "Waiting for application shutdown" in log.read_text(),
                   what="uvicorn to start its lifespan shutdown")
        for hold in holds:
            hold.release()
        assert server.wait(timeout=60) in (0, -signal.SIGTERM), log.read_text()[-2000:]

        def performed(key: str) -> int:
            return (email if key.startswith("email-") else stripe).performed(key)

        every = _job_rows(shop_dsn)
        jobs = [job for job in every if not job[0].startswith("email-receipt-")]
        assert len(jobs) == 20
        # Each charge recorded done enqueued its receipt in the same transaction.
        charged = {key.removeprefix("payment-order-") for key, status, _ in jobs
                   if key.startswith("payment-order-") and status == "done"}
        assert {key.removeprefix("email-receipt-") for key, _, _ in every
                if key.startswith("email-receipt-")} == charged
        for key, status, attempts in jobs:
            if performed(key):
                assert status == "done", (key, status)
            else:
                assert (status, attempts) == ("pending", 0), (key, status, attempts)
        assert sum(status == "done" for _, status, _ in jobs) >= 2  # the held two
        app.dispatcher(env).run_until_idle(timeout=60)
        finished = _job_rows(shop_dsn)
        assert {status for _, status, _ in finished} == {"done"}
        assert len(finished) == 30  # each order: its email, its charge, its receipt
        assert all(performed(key) == 1 for key, _, _ in finished)


def _job_rows(dsn: str) -> list[tuple[str, str, int]]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT key, status, attempts FROM outbox.jobs ORDER BY key")
        return [(str(k), str(s), int(a)) for k, s, a in rows]
