"""The example shop: atomic orders through its HTTP interface, and the demo's end-to-end
"once" check."""

from __future__ import annotations

import os
import signal
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
from outbox.testing import jobs

from ..integration.helpers import wait_until


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
    env = {**os.environ, "OUTBOX_DATABASE_URL": shop_dsn}
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

        jobs = _job_rows(shop_dsn)
        assert len(jobs) == 20
        for key, status, attempts in jobs:
            if performed(key):
                assert status == "done", (key, status)
            else:
                assert (status, attempts) == ("pending", 0), (key, status, attempts)
        assert sum(status == "done" for _, status, _ in jobs) >= 2  # the held two
        app.dispatcher(env).run_until_idle(timeout=60)
        assert {status for _, status, _ in _job_rows(shop_dsn)} == {"done"}
        assert all(performed(key) == 1 for key, _, _ in jobs)


def _job_rows(dsn: str) -> list[tuple[str, str, int]]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT key, status, attempts FROM outbox.jobs ORDER BY key")
        return [(str(k), str(s), int(a)) for k, s, a in rows]
