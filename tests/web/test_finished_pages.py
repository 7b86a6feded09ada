"""The job list of one finished status (done, failed, reconcile): most recently finished
first, paged on (updated_at, id), every job once, ties on updated_at included."""

from __future__ import annotations

import html
import re
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from .support import seed

pytestmark = pytest.mark.anyio


async def test_failed_jobs_page_by_when_they_failed_every_job_once(
        client: httpx.AsyncClient, dsn: str, schema: str) -> None:
    start = datetime(2026, 3, 1, tzinfo=UTC)
    # 130 failed jobs whose ids run against when they failed, 3 to a second (ties), and
    # pending jobs between them, which the failed pages never show
    ids = seed(dsn, schema, *(
        {"key": f"f{i:03d}", "status": "failed",
         "updated_at": (start - timedelta(seconds=i // 3)).isoformat()}
        for i in range(130)))
    seed(dsn, schema, *({"key": f"p{i}"} for i in range(20)))
    seen: list[int] = []
    url: str | None = "/jobs?status=failed"
    pages = 0
    while url:
        page = (await client.get(url)).text
        pages += 1
        seen += [int(i) for i in re.findall(r'<tr id="job-(\d+)"', page)]
        more = re.search(r'<a href="(/jobs\?[^"]*before=\d+[^"]*)"', page)
        url = html.unescape(more[1]) if more else None
        assert url is None or "before_at=" in url
    assert pages == 3
    # most recently failed first (the lowest ids here), ties by id, newest first
    expected = sorted(ids, key=lambda job_id: (ids.index(job_id) // 3, -job_id))
    assert seen == expected


async def test_a_bad_page_time_is_named_in_a_400(client: httpx.AsyncClient) -> None:
    response = await client.get("/jobs", params={"status": "done", "before": "5",
                                                  "before_at": "yesterday"})
    assert response.status_code == 400
    assert "before_at" in response.text and "not a time" in response.text
