"""The tutorial's code (docs/tutorial/code) does what the tutorial says: orders are
charged once each, the charge is recorded on its order by ``on_done``, each receipt is
sent once within the email limit, and a dispatcher killed -9 mid-run loses nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from effects.testing import FakeEmailProvider, FakeStripe

from .. import test_readme
from ..test_readme import ROOT

database = test_readme.database  # a database of its own, migrated

CODE = ROOT / "docs" / "tutorial" / "code"
ORDERS = 6


@pytest.fixture
def providers() -> Iterator[tuple[FakeStripe, FakeEmailProvider]]:
    with FakeStripe() as stripe, FakeEmailProvider(rate_limit=2.0) as resend:
        yield stripe, resend


def _env(database: str, stripe: FakeStripe, resend: FakeEmailProvider) -> dict[str, str]:
    return {**os.environ, "OUTBOX_DATABASE_URL": database,
            "STRIPE_BASE_URL": stripe.url, "STRIPE_API_KEY": "sk_test_tutorial",
            "RESEND_BASE_URL": resend.url, "RESEND_API_KEY": "re_tutorial",
            "PYTHONPATH": str(CODE)}


def test_the_shop_survives_a_kill_9(database: str,
                                    providers: tuple[FakeStripe, FakeEmailProvider]) -> None:
    stripe, resend = providers
    env = _env(database, stripe, resend)
    placed = subprocess.run([sys.executable, "-W", "error", str(CODE / "shop.py"), "1",
                             str(ORDERS)], env=env, cwd=CODE, capture_output=True, text=True,
                            timeout=60, check=False)
    assert placed.returncode == 0, placed.stderr
    hold = stripe.hold_next()  # the first charge stays in flight: kill -9 lands mid-run
    command = [str(Path(sys.executable).parent / "outbox"), "run", "shop:dispatcher"]
    worker = subprocess.Popen(command, env=env, cwd=CODE, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        hold.wait_for_arrival()
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait(10)
    hold.release()
    finish = ("import shop; stats = shop.dispatcher.run_until_idle(timeout=90); "
              "print(stats)")
    done = subprocess.run([sys.executable, "-c", finish], env=env, cwd=CODE,
                          capture_output=True, text=True, timeout=110, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    for order_id in range(1, ORDERS + 1):
        assert stripe.performed(f"charge-order-{order_id}") == 1, order_id
        assert resend.performed(f"receipt-order-{order_id}") == 1, order_id
    with psycopg.connect(database) as conn:
        charged = conn.execute("SELECT count(*) FROM orders WHERE charge_id LIKE 'pi_%'"
                               ).fetchone()
    assert charged == (ORDERS,)
