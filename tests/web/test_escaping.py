"""Nothing from a payload, key or error is ever rendered unescaped."""

from __future__ import annotations

import httpx
import pytest

from .support import seed

pytestmark = pytest.mark.anyio

HOSTILE = '<script>alert(1)</script><img src=x onerror="alert(2)">'


async def test_hostile_text_is_escaped_on_every_page(
        client: httpx.AsyncClient, dsn: str, schema: str) -> None:
    [job_id] = seed(dsn, schema, {
        "key": "k<script>alert(3)</script>", "effect": "e<b>x</b>", "status": "failed",
        "last_error": HOSTILE, "payload": {"html": HOSTILE, HOSTILE: 1}})
    pages = [await client.get(path) for path in (
        "/", "/jobs", "/jobs?status=failed", f"/jobs/{job_id}",
        "/jobs?error=" + "%3Cscript%3E", "/jobs?key_prefix=%3Cimg")]
    for response in pages:
        assert response.status_code == 200
        assert "<script>alert" not in response.text
        assert "<img src=x" not in response.text
        assert "<b>x</b>" not in response.text
    detail = pages[3].text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in detail
    assert "&lt;img src=x onerror=" in detail


async def test_a_filter_value_is_reflected_escaped(client: httpx.AsyncClient) -> None:
    response = await client.get("/jobs", params={"error": '"><script>alert(4)</script>'})
    assert "<script>alert(4)" not in response.text
    assert "&#34;&gt;&lt;script&gt;" in response.text
