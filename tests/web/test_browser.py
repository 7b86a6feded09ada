"""Browser smoke tests: Playwright driving Debian's chromium against a live dashboard.

Skipped when /usr/bin/chromium is missing (``apt-get install -y chromium``); Playwright's
own browser download is not used.
"""

from __future__ import annotations

import os
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import uvicorn

from outbox import Target
from outbox.testing import create_schema, drop_schema
from outbox.web import create_app
from outbox.web import target_slug as slug_of

from .support import job, seed

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
SCREENSHOTS = os.environ.get("OUTBOX_SCREENSHOTS")  # a directory to save screenshots in

pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists(),
    reason="needs Debian's chromium: apt-get update && apt-get install -y chromium")

HOSTILE = ('<script>window.__pwned = "script"</script>'
           '<img src=x onerror="window.__pwned = \'img\'">')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _NotifyingServer(uvicorn.Server):
    """A uvicorn server that sets ``ready`` once it listens."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = threading.Event()

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        self.ready.set()


@pytest.fixture
def serve(dsn: str, schema: str) -> Iterator[Callable[..., str]]:
    """Start dashboards on loopback ports in background threads; return their URLs."""
    servers: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(**options: Any) -> str:
        port = _free_port()
        app = (create_app(**options) if "targets" in options
               else create_app(dsn, schema=schema, **options))
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                lifespan="on")
        server = _NotifyingServer(config)

        def run() -> None:
            server.run()
            server.ready.set()  # it stopped, perhaps failing to start: do not wait on

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        assert server.ready.wait(20), "the dashboard did not start"
        assert server.started, "the dashboard failed to start"
        servers.append((server, thread))
        return f"http://127.0.0.1:{port}"

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        launched = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield launched
        launched.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    opened = context.new_page()
    opened.csp_violations = []
    opened.dialogs = []
    opened.on("console", lambda m: opened.csp_violations.append(m.text)
              if "Content Security Policy" in m.text else None)
    opened.on("dialog", lambda d: (opened.dialogs.append(d.message), d.dismiss()))
    yield opened
    context.close()


def _shot(page: Any, name: str) -> None:
    if SCREENSHOTS:
        Path(SCREENSHOTS).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(SCREENSHOTS) / name), full_page=True)


def test_the_overview_renders(serve: Callable[..., str], page: Any, dsn: str,
                              schema: str) -> None:
    seed(dsn, schema, *({"key": f"d{i}", "status": "done"} for i in range(30)),
         {"key": "f1", "status": "failed", "effect": "charge.card", "last_error": "declined"},
         {"key": "r1", "status": "running", "claimed_by": "web-1:4242"},
         {"key": "p1"}, {"key": "c1", "status": "reconcile", "effect": "charge.card"})
    page.goto(serve() + "/")
    assert page.title() == "outbox: overview"
    assert page.locator(".tile.status-done .n").inner_text() == "30"
    assert page.locator("svg rect").count() > 60
    assert page.get_by_text("web-1:4242").is_visible()
    _shot(page, "overview.png")
    assert page.csp_violations == []


def test_a_limits_home_shows_its_shared_buckets(serve: Callable[..., str], page: Any,
                                                dsn: str, schema: str) -> None:
    seed(dsn, schema, {"key": "p1", "effect": "charge.card"})
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'INSERT INTO "{schema}".shared_limits (effect, rate, burst, tokens, '
                     "refilled_at, paused_until, throttles, granted_total, declared_at) "
                     "VALUES ('charge.card', 90, 10, 3.5, now(), now() + interval '30 s', "
                     "2, 123456, now()), ('email.send', 2, 1, 1, now(), NULL, 0, 800, now())")
    page.goto(serve() + "/")
    heading = page.get_by_role("heading", name="Limits shared across targets, counted here")
    assert heading.is_visible()
    rows = page.locator("table:below(h2:has-text('Limits shared across targets')) tbody tr")
    assert "90/s, burst 10" in rows.first.inner_text()
    _shot(page, "shared-limits.png")
    assert page.csp_violations == []


def test_the_picker_switches_between_targets(serve: Callable[..., str], page: Any,
                                            dsn: str) -> None:
    tag = uuid.uuid4().hex[:4]  # schemas named like tenants', unique to this run
    acme, globex = create_schema(dsn, f"acme_{tag}"), create_schema(dsn, f"globex_{tag}")
    try:
        seed(dsn, acme, *({"key": f"d{i}", "status": "done"} for i in range(12)),
             {"key": "p1"}, {"key": "p2"})
        seed(dsn, globex, *({"key": f"d{i}", "status": "done"} for i in range(30)),
             {"key": "f1", "status": "failed", "effect": "charge.card",
              "last_error": "card declined"},
             {"key": "r1", "status": "running", "claimed_by": "web-2:4242"}, {"key": "p1"})
        targets = [Target(dsn, acme), Target(dsn, globex), Target(dsn, f"initech_{tag}")]
        base = serve(targets=targets)
        page.goto(base + "/")
        assert page.title() == "outbox: targets"
        assert page.locator("table.targets tbody tr").count() == 3
        assert "has no outbox tables" in page.locator("tr.down").inner_text()
        _shot(page, "targets.png")
        page.select_option("form.picker select", slug_of(targets[1]))  # opens it (picker.js)
        page.wait_for_url(f"**/t/{slug_of(targets[1])}/")
        assert page.title() == "outbox: overview"
        assert page.locator(".tile.status-done .n").inner_text() == "30"
        assert page.get_by_text("web-2:4242").is_visible()
        assert page.locator("form.picker select").input_value() == slug_of(targets[1])
        _shot(page, "overview-targets.png")
        page.click("header nav >> text=Jobs")
        page.wait_for_url(f"**/t/{slug_of(targets[1])}/jobs")
        page.select_option("form.picker select", slug_of(targets[0]))  # the same page there
        page.wait_for_url(f"**/t/{slug_of(targets[0])}/jobs")
        assert page.locator("td.key").count() == 14
        assert page.csp_violations == []
    finally:
        drop_schema(dsn, acme)
        drop_schema(dsn, globex)


def test_a_filter_narrows_the_list(serve: Callable[..., str], page: Any, dsn: str,
                                   schema: str) -> None:
    seed(dsn, schema, {"key": "a1"}, {"key": "a2", "status": "failed"},
         {"key": "b1", "status": "failed", "effect": "charge.card"})
    page.goto(serve() + "/jobs")
    assert page.locator("tbody#job-rows tr").count() == 3
    page.select_option("select[name=status]", "failed")
    page.click("text=Filter")
    page.wait_for_url("**/jobs?status=failed*")
    assert page.locator("tbody#job-rows tr").count() == 2
    page.fill("input[name=key_prefix]", "b")
    page.click("text=Filter")
    page.wait_for_url("**key_prefix=b*")
    assert page.locator("td.key").all_inner_texts() == ["b1"]


def test_a_retry_button_changes_the_row(serve: Callable[..., str], page: Any, dsn: str,
                                        schema: str) -> None:
    [job_id] = seed(dsn, schema, {"key": "f1", "status": "failed", "claim_version": 3,
                                  "last_error": "HTTP 503"})
    page.goto(serve() + "/jobs?status=failed")
    row = page.locator(f"#job-{job_id}")
    assert row.locator(".badge").inner_text() == "failed"
    row.get_by_role("button", name="Retry").click()
    page.locator(f"#job-{job_id} .flash").wait_for()
    assert page.locator(f"#job-{job_id} .badge").inner_text() == "pending"
    assert page.locator(f"#job-{job_id} .flash").inner_text() == "Job sent back to pending."
    assert job(dsn, schema, job_id)["status"] == "pending"
    assert page.csp_violations == []


def test_read_only_mode_shows_no_buttons(serve: Callable[..., str], page: Any, dsn: str,
                                         schema: str) -> None:
    [job_id] = seed(dsn, schema, {"key": "f1", "status": "failed"},)
    base = serve(read_only=True)
    for path in ("/", "/jobs?status=failed", f"/jobs/{job_id}"):
        page.goto(base + path)
        assert page.locator("button[type=submit]:not(.filters button)").count() == 0


def test_a_hostile_payload_never_executes(serve: Callable[..., str], page: Any, dsn: str,
                                          schema: str) -> None:
    [job_id] = seed(dsn, schema, {"key": "x<script>window.__pwned='key'</script>",
                                  "status": "failed", "last_error": HOSTILE,
                                  "payload": {"html": HOSTILE, "text": "hello " * 20}})
    base = serve()
    for path in ("/", "/jobs", f"/jobs/{job_id}"):
        page.goto(base + path)
        page.wait_for_load_state("load")
        assert page.evaluate("window.__pwned") is None
    assert page.locator("pre.error").inner_text() == HOSTILE  # shown as text
    _shot(page, "job.png")
    assert page.dialogs == []


def test_older_jobs_load_below_the_page(serve: Callable[..., str], page: Any, dsn: str,
                                        schema: str) -> None:
    ids = seed(dsn, schema, *({"key": f"k{i:03d}", "status": "failed"} for i in range(70)))
    page.goto(serve() + "/jobs?status=failed")
    assert page.locator("tbody#job-rows tr[id^=job-]").count() == 50
    page.click("text=Older jobs")
    page.locator(f"#job-{min(ids)}").wait_for()
    shown = page.locator("tbody#job-rows tr[id^=job-]").evaluate_all(
        "rows => rows.map(r => Number(r.id.slice(4)))")
    assert shown == sorted(ids, reverse=True)
    assert page.url.endswith("/jobs?status=failed")  # swapped in place, no navigation
    assert page.csp_violations == []
