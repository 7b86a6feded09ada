"""The example shop: atomic orders, and the demo's end-to-end "once" check."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

from examples.shop import app, demo
from outbox.testing import jobs


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


def test_an_order_and_its_two_effects_commit_together(shop_dsn: str) -> None:
    with psycopg.connect(shop_dsn) as conn:
        app.setup(conn)
        order_id = app.place_order(conn, customer="ada", email="ada@example.com", amount=1250)
        with pytest.raises(psycopg.errors.CheckViolation):
            app.place_order(conn, customer="bob", email="bob@example.com", amount=-1)
        found = jobs(conn, app.OUTBOX_SCHEMA)
        orders = conn.execute("SELECT count(*) FROM shop_orders").fetchone()
    assert {key: job["effect"] for key, job in found.items()} == {
        f"email-order-{order_id}": "email.send", f"payment-order-{order_id}": "payment.charge"}
    assert orders == (1,)


def test_the_demo_kills_a_worker_and_still_performs_everything_once(shop_dsn: str) -> None:
    assert demo.run_demo(shop_dsn, orders=80, seed=7) == 0
