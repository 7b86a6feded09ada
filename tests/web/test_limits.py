"""The dashboard and its /metrics on provider limits: paused effects and why, pause and
resume actions (POST, refused cross-site, audited), failed jobs grouped by cause."""

from __future__ import annotations

import httpx
import psycopg
import pytest

from outbox.sql import queries

from .conftest import SAME_ORIGIN, ClientFactory
from .support import audit, seed

pytestmark = pytest.mark.anyio


async def test_pause_and_resume_an_effect_from_the_overview(
        client: httpx.AsyncClient, dsn: str, schema: str) -> None:
    seed(dsn, schema, {"key": "e1", "effect": "email.send", "status": "pending"})
    response = await client.post("/effects/pause", data={"effect": "email.send", "minutes": "10"},
                                 headers=SAME_ORIGIN)
    assert response.status_code == 303
    page = (await client.get("/")).text
    assert "Provider limits" in page and "<strong>operator</strong> by anonymous@127.0.0.1" in page
    [entry] = audit(dsn, schema)
    assert (entry["action"], entry["actor"], entry["affected"]) == (
        "pause", "anonymous@127.0.0.1", 1)
    assert entry["detail"] == {"effect": "email.send", "seconds": 600.0}

    await client.post("/effects/resume", data={"effect": "email.send"}, headers=SAME_ORIGIN)
    assert "<strong>operator</strong>" not in (await client.get("/")).text
    assert [e["action"] for e in audit(dsn, schema)] == ["pause", "resume"]


async def test_a_pause_without_end_shows_until_resumed(
        client: httpx.AsyncClient, dsn: str, schema: str) -> None:
    response = await client.post("/effects/pause", data={"effect": "email.send", "minutes": ""},
                                 headers=SAME_ORIGIN)
    assert response.status_code == 303
    page = (await client.get("/")).text
    assert "<strong>operator</strong> by anonymous@127.0.0.1, until resumed" in page


async def test_effect_actions_are_refused_cross_site_and_checked(
        client: httpx.AsyncClient, dsn: str, schema: str) -> None:
    refused = await client.post("/effects/pause", data={"effect": "email.send"},
                                headers={"sec-fetch-site": "cross-site"})
    assert refused.status_code == 403
    bad = await client.post("/effects/pause", data={"effect": "email.send", "minutes": "soon"},
                            headers=SAME_ORIGIN)
    assert bad.status_code == 400 and "minutes" in bad.text
    unnamed = await client.post("/effects/pause", data={}, headers=SAME_ORIGIN)
    assert unnamed.status_code == 400
    assert audit(dsn, schema) == []


async def test_read_only_dashboard_refuses_pausing(
        make_client: ClientFactory, dsn: str, schema: str) -> None:
    client = await make_client(read_only=True)
    response = await client.post("/effects/pause", data={"effect": "email.send"},
                                 headers=SAME_ORIGIN)
    assert response.status_code == 403
    assert "Pause effect" not in (await client.get("/")).text


async def test_failed_jobs_are_grouped_by_effect_and_error_shape(
        client: httpx.AsyncClient, dsn: str, schema: str) -> None:
    for i, request in enumerate(["req_8f2a9c1d77", "req_00aa11bb22", "req_ffee00dd99"]):
        seed(dsn, schema, {"key": f"f{i}", "effect": "email.send", "status": "failed",
                           "last_error": f"Retry: HTTP 503 after {i + 2}.5 s ({request}) "
                                         f"(attempt {25} of 25)"})
    seed(dsn, schema, {"key": "g0", "effect": "email.send", "status": "failed",
                       "last_error": "Permanent: 422 validation_error"})
    with psycopg.connect(dsn, autocommit=True) as conn:
        groups = conn.execute(queries(schema).failed_groups, {"limit": 10}).fetchall()
    assert [(g[0], g[1], g[2]) for g in groups] == [
        ("email.send", "Retry: HTTP N after N s (<id>) (attempt N of N)", 3),
        ("email.send", "Permanent: N validation_error", 1)]
    page = (await client.get("/")).text
    assert "Failed jobs by cause" in page
    assert "error=Retry%3A%20HTTP" in page  # the link to the group's jobs, to retry in bulk


async def test_metrics_show_paused_effects_and_throttles(
        make_client: ClientFactory, dsn: str, schema: str) -> None:
    q = queries(schema)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(q.limit_ensure, {"effect": "email.send"})
        conn.execute(q.limit_throttled, {"effect": "email.send", "count": 3, "after": 60.0,
                                         "hint": 2.0})
        conn.execute(q.limit_pause, {"effect": "payment.charge", "seconds": None,
                                     "actor": "ada"})
    client = await make_client()
    body = (await client.get("/metrics")).text
    assert 'outbox_effect_paused{effect="email.send",reason="throttled"} 1.0' in body
    assert 'outbox_effect_paused{effect="email.send",reason="operator"} 0.0' in body
    assert 'outbox_effect_paused{effect="payment.charge",reason="operator"} 1.0' in body
    assert 'outbox_effect_throttled_total{effect="email.send"} 3.0' in body


async def test_a_limit_per_group_and_its_throttled_groups_are_shown(
        client: httpx.AsyncClient, dsn: str, schema: str) -> None:
    # As dispatchers leave them (migration 0012): the declaration on the effect's row,
    # one group of the effect paused by its provider account's throttle.
    with psycopg.connect(dsn) as conn:
        conn.execute(f'INSERT INTO "{schema}".effect_limits (effect, tokens, group_rate, '
                     "group_concurrency, group_declared_at) "
                     "VALUES ('email.send', 1e9, 2, 3, now())")
        conn.execute(f'INSERT INTO "{schema}".group_limits (effect, group_key, tokens, '
                     "refilled_at, throttled_total, paused_until) "
                     "VALUES ('email.send', 'acme', 0, now(), 4, now() + interval '1 hour')")
    page = (await client.get("/")).text
    assert "per group: 2/s, 3 in flight; <strong>1 group throttled</strong>" in page


async def test_the_limits_shared_across_targets_counted_here_are_shown(
        client: httpx.AsyncClient, dsn: str, schema: str) -> None:
    page = (await client.get("/")).text
    assert "Limits shared across targets" not in page  # not a limits home: no table
    # As claims in other targets leave it (migration 0013): a bucket, throttled lately.
    with psycopg.connect(dsn) as conn:
        conn.execute(f'INSERT INTO "{schema}".shared_limits (effect, rate, burst, tokens, '
                     "refilled_at, paused_until, throttles, granted_total, declared_at) "
                     "VALUES ('payment.charge', 90, 10, 3.5, now(), now() + interval '30 s', "
                     "2, 12345, now())")
    page = (await client.get("/")).text
    assert "Limits shared across targets, counted here" in page
    assert "<td>payment.charge</td><td>90/s, burst 10</td>" in page
    assert "12,345" in page and "<strong>throttled</strong>" in page
