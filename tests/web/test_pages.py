"""The dashboard's pages against real PostgreSQL: overview, list filters, paging, detail."""

from __future__ import annotations

import re

import httpx
import pytest

from .conftest import ClientFactory
from .support import seed

pytestmark = pytest.mark.anyio


async def test_overview_shows_counts_per_status_and_effect(
        client: httpx.AsyncClient, dsn: str, schema: str) -> None:
    seed(dsn, schema,
         {"key": "a", "status": "pending", "available_at": "2026-01-01"},
         {"key": "b", "status": "failed", "effect": "charge.card"},
         {"key": "c", "status": "failed", "effect": "charge.card"},
         {"key": "d", "status": "running", "claimed_by": "worker-7:1"},
         {"key": "e", "status": "done"})
    response = await client.get("/")
    assert response.status_code == 200
    page = response.text
    assert re.search(r'<span class="n">2</span>\s*<span class="label">failed</span>', page)
    assert re.search(r'<span class="n">1</span>\s*<span class="label">pending</span>', page)
    assert "charge.card" in page and "email.send" in page
    assert "worker-7:1" in page  # a dispatcher holding a claim
    assert "1 done, 2 failed" in page  # settled within the hour
    assert "failure rate 66.7 %" in page


async def test_overview_shows_the_busiest_groups_of_effects_with_groups(
        client: httpx.AsyncClient, dsn: str, schema: str) -> None:
    seed(dsn, schema,
         *[{"key": f"acme-{n}", "group_key": "acme"} for n in range(3)],
         {"key": "beta-1", "group_key": "beta"}, {"key": "plain-1"},
         {"key": "sms-1", "effect": "sms.send"},
         {"key": "<b>x</b>", "group_key": "<b>evil</b>"})
    page = (await client.get("/")).text
    assert "<h2>Busiest groups</h2>" in page
    # Ties in byte order, the jobs without a group ('') first.
    assert ("<td>email.send</td><td>acme 3, <em>(no group)</em> 1, "
            "&lt;b&gt;evil&lt;/b&gt; 1, beta 1</td>") in page
    assert "<td>sms.send</td>" not in page, "an effect whose jobs name no group"
    assert "<b>evil</b>" not in page, "a group's name is escaped"


async def test_every_page_carries_a_content_security_policy(client: httpx.AsyncClient) -> None:
    for path in ("/", "/jobs", "/jobs/999999"):
        response = await client.get(path)
        policy = response.headers["content-security-policy"]
        assert "script-src 'self'" in policy and "default-src 'none'" in policy
        assert "unsafe-inline" not in policy
        assert response.headers["x-frame-options"] == "DENY"


async def test_filters_narrow_the_list(client: httpx.AsyncClient, dsn: str, schema: str) -> None:
    seed(dsn, schema,
         {"key": "order-1-email", "status": "failed", "last_error": "HTTP 503 from Resend"},
         {"key": "order-2-email", "status": "failed", "last_error": "bad address"},
         {"key": "order-2-charge", "status": "pending", "effect": "charge.card"},
         {"key": "old-one", "status": "pending", "created_at": "2020-01-01"})

    async def keys(**params: str) -> set[str]:
        response = await client.get("/jobs", params=params)
        assert response.status_code == 200, response.text
        return set(re.findall(r'<td class="key">([^<]*)</td>', response.text))

    assert await keys() == {"order-1-email", "order-2-email", "order-2-charge", "old-one"}
    assert await keys(status="failed") == {"order-1-email", "order-2-email"}
    assert await keys(effect="charge.card") == {"order-2-charge"}
    assert await keys(key_prefix="order-2") == {"order-2-email", "order-2-charge"}
    assert await keys(error="http 503") == {"order-1-email"}
    assert await keys(older_than="30d") == {"old-one"}
    assert await keys(newer_than="1h", status="pending") == {"order-2-charge"}


async def test_a_bad_filter_is_named_in_a_400(client: httpx.AsyncClient) -> None:
    response = await client.get("/jobs", params={"older_than": "soon"})
    assert response.status_code == 400
    assert "older than" in response.text and "duration" in response.text
    response = await client.get("/jobs", params={"status": "lost"})
    assert response.status_code == 400 and "status: must be one of" in response.text


async def test_keyset_pages_walk_every_job_once(
        client: httpx.AsyncClient, dsn: str, schema: str) -> None:
    ids = seed(dsn, schema, *({"key": f"k{i:03d}"} for i in range(120)))
    seen: list[int] = []
    url: str | None = "/jobs"
    while url:
        page = (await client.get(url)).text
        seen += [int(i) for i in re.findall(r'<tr id="job-(\d+)"', page)]
        more = re.search(r'<a href="(/jobs\?before=\d+)"', page)
        url = more[1] if more else None
    assert seen == sorted(ids, reverse=True)


async def test_the_list_counts_matches_up_to_a_cap(
        client: httpx.AsyncClient, dsn: str, schema: str) -> None:
    seed(dsn, schema, *({"key": f"k{i}", "status": "failed"} for i in range(3)))
    assert "3 jobs match." in (await client.get("/jobs?status=failed")).text
    assert "0 jobs match." in (await client.get("/jobs?status=reconcile")).text


async def test_job_detail_shows_lease_error_ledger_and_truncated_payload(
        client: httpx.AsyncClient, dsn: str, schema: str) -> None:
    [running] = seed(dsn, schema, {"key": "r1", "status": "running", "claimed_by": "w-9:3",
                                   "attempts": 2, "last_error": "HTTP 500 earlier",
                                   "payload": {"text": "x" * 5000}})
    page = (await client.get(f"/jobs/{running}")).text
    assert "held by w-9:3 until" in page
    assert "2 of 25" in page and "HTTP 500 earlier" in page
    assert "more characters not shown" in page
    assert "x" * 5000 not in page
    assert "No ledger row" in page


async def test_redact_decides_what_of_the_payload_is_shown(
        make_client: ClientFactory, dsn: str, schema: str) -> None:
    [job_id] = seed(dsn, schema, {"key": "p1", "payload": {"card": "4242424242424242",
                                                            "amount": 1200}})
    client = await make_client(redact=lambda effect, p: {**p, "card": "****"})
    page = (await client.get(f"/jobs/{job_id}")).text
    assert "4242424242424242" not in page
    assert "****" in page and "1200" in page


@pytest.mark.parametrize("due", ["infinity", "200000-01-01 00:00:00+00", "-infinity",
                                 "0100-01-01 00:00:00+00 BC"])
async def test_a_job_due_past_the_calendar_python_knows_is_listed_and_shown(
        client: httpx.AsyncClient, dsn: str, schema: str, due: str) -> None:
    # PostgreSQL stores what Python's datetime cannot hold (SQL callers may write it:
    # run_at => 'infinity'); one such row made every page listing it answer 500.
    [odd, plain] = seed(dsn, schema, {"key": "odd", "available_at": due}, {"key": "plain"})
    listed = await client.get("/jobs")
    assert listed.status_code == 200 and f"/jobs/{odd}" in listed.text
    assert f"/jobs/{plain}" in listed.text
    shown = await client.get(f"/jobs/{odd}")
    assert shown.status_code == 200 and "odd" in shown.text


async def test_an_unknown_job_is_a_404(client: httpx.AsyncClient) -> None:
    response = await client.get("/jobs/424242")
    assert response.status_code == 404 and "No job 424242" in response.text


async def test_htmx_is_served_from_the_package(client: httpx.AsyncClient) -> None:
    response = await client.get("/static/htmx.min.js")
    assert response.status_code == 200
    assert "htmx" in response.text[:200]


async def test_a_search_past_the_statement_timeout_asks_for_a_narrower_filter(
        client: httpx.AsyncClient, dsn: str, schema: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import psycopg

    from outbox.web import app as web_app

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'INSERT INTO "{schema}".jobs (effect, key, payload, fingerprint, '
                     "last_error) SELECT 'e', 'k' || i, '{}', 'f', 'error ' || i "
                     "FROM generate_series(1, 200000) i")
    # A full scan of 200,000 rows cannot finish within a millisecond.
    monkeypatch.setattr(web_app, "STATEMENT_TIMEOUT", "1ms")
    response = await client.get("/jobs", params={"error": "no such text"})
    assert response.status_code == 503
    assert "took longer than 1ms and was stopped. Narrow the filter" in response.text
