"""The tutorial's code (docs/tutorial/code) does what the tutorial says: orders are
charged once each, the charge is recorded on its order by ``on_done``, each receipt is
sent once within the email limit, and a dispatcher killed -9 mid-run loses nothing."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from effects.testing import FakeEmailProvider, FakeStripe

from .. import test_readme
from ..test_readme import ROOT

database = test_readme.database  # a database of its own, migrated

CODE = ROOT / "docs" / "tutorial" / "code"
SCREENSHOT = ROOT / "docs" / "tutorial" / "dashboard.png"
CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
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
    _the_dashboard_shows_it(env)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _the_dashboard_shows_it(env: dict[str, str]) -> None:
    """The tutorial's last step, in a real browser; with OUTBOX_DOCS_SCREENSHOTS set
    (make docs-screenshots) its screenshot replaces the tutorial's."""
    if not Path(CHROMIUM).exists():
        pytest.skip("needs Debian's chromium: apt-get update && apt-get install -y chromium")
    from playwright.sync_api import sync_playwright

    port = _free_port()
    web = subprocess.Popen([str(Path(sys.executable).parent / "outbox"), "web", "--port",
                            str(port)], env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        _wait_until_listening(port, web)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
            page = browser.new_page(viewport={"width": 1280, "height": 760})
            page.goto(f"http://127.0.0.1:{port}/")
            done = page.locator(".tile.status-done .n").inner_text()
            limits = page.get_by_text("Provider limits").count()
            if os.environ.get("OUTBOX_DOCS_SCREENSHOTS"):
                page.screenshot(path=str(SCREENSHOT))
            browser.close()
    finally:
        web.terminate()
        web.wait(10)
    assert done == str(2 * ORDERS)
    assert limits == 1


def _wait_until_listening(port: int, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert process.poll() is None, f"outbox web exited with {process.returncode}"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)  # polling a port: there is no event to wait on
    pytest.fail("outbox web did not listen within 30 s")
