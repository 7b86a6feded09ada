"""Dashboard actions: fenced, audited, refused cross-site, absent in read-only mode."""

from __future__ import annotations

import re

import httpx
import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from outbox.web import BasicAuth

from .conftest import SAME_ORIGIN, ClientFactory
from .support import audit, job, ledger, seed

pytestmark = pytest.mark.anyio


def form(claim_version: int, status: str = "", **extra: str) -> dict[str, str]:
    return {"claim_version": str(claim_version), "status": status, **extra}


async def test_retry_sends_a_failed_job_back_to_pending_and_audits_it(
        client: httpx.AsyncClient, dsn: str, schema: str) -> None:
    [job_id] = seed(dsn, schema, {"key": "f1", "status": "failed", "attempts": 25,
                                  "claim_version": 25, "last_error": "gave up"})
    response = await client.post(f"/jobs/{job_id}/retry", data=form(25, "failed"),
                                 headers=SAME_ORIGIN)
    assert response.status_code == 303
    assert response.headers["location"] == f"/jobs/{job_id}?outcome=retried"
    row = job(dsn, schema, job_id)
    assert (row["status"], row["attempts"], row["claim_version"]) == ("pending", 0, 25)
    [entry] = audit(dsn, schema)
    assert (entry["action"], entry["job_id"], entry["affected"]) == ("retry", job_id, 1)
    assert entry["actor"] == "anonymous@127.0.0.1"
    page = (await client.get(response.headers["location"])).text
    assert "Job sent back to pending." in page


async def test_an_action_on_a_job_that_moved_on_changes_nothing_and_says_so(
        client: httpx.AsyncClient, dsn: str, schema: str) -> None:
    [job_id] = seed(dsn, schema, {"key": "f2", "status": "failed", "claim_version": 3})
    # Meanwhile someone else retried it and a dispatcher claimed it again (version 4).
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'UPDATE "{schema}".jobs SET status = %s, claim_version = 4, '
                     "lease_until = now() + interval '1 minute', claimed_by = 'w' "
                     "WHERE id = %s", ("running", job_id))
    before = job(dsn, schema, job_id)
    response = await client.post(f"/jobs/{job_id}/retry", data=form(3, "failed"),
                                 headers=SAME_ORIGIN, follow_redirects=True)
    assert "The job moved on before your action: nothing was changed." in response.text
    assert job(dsn, schema, job_id) == before
    [entry] = audit(dsn, schema)
    assert (entry["action"], entry["affected"]) == ("retry", 0)


async def test_a_stale_claim_version_alone_is_enough_to_fence(
        client: httpx.AsyncClient, dsn: str, schema: str) -> None:
    [job_id] = seed(dsn, schema, {"key": "f3", "status": "failed", "claim_version": 7})
    await client.post(f"/jobs/{job_id}/retry", data=form(6, "failed"), headers=SAME_ORIGIN)
    assert job(dsn, schema, job_id)["status"] == "failed"


async def test_retry_from_the_list_swaps_the_row(
        client: httpx.AsyncClient, dsn: str, schema: str) -> None:
    [job_id] = seed(dsn, schema, {"key": "f4", "status": "failed", "claim_version": 1})
    response = await client.post(f"/jobs/{job_id}/retry", headers={
        **SAME_ORIGIN, "hx-request": "true"}, data=form(1, "failed", view="row"))
    assert response.status_code == 200
    assert response.text.strip().startswith(f'<tr id="job-{job_id}" class="status-pending">')
    assert "Job sent back to pending." in response.text
    assert ">Retry<" not in response.text  # a pending job offers no retry


async def test_cancel_fails_a_pending_job_naming_who(
        make_client: ClientFactory, dsn: str, schema: str) -> None:
    [job_id] = seed(dsn, schema, {"key": "p1"})
    client = await make_client(authorize=BasicAuth("s3cret"))
    response = await client.post(f"/jobs/{job_id}/cancel", data=form(0), auth=("ada", "s3cret"),
                                 headers=SAME_ORIGIN)
    assert response.status_code == 303
    row = job(dsn, schema, job_id)
    assert row["status"] == "failed"
    assert row["last_error"] == "cancelled from the dashboard by ada"
    assert audit(dsn, schema)[0]["actor"] == "ada"


async def test_a_running_jobs_cancel_asks_its_claim_to_stop(
        client: httpx.AsyncClient, dsn: str, schema: str) -> None:
    # The job stays running until its dispatcher records what the perform did once told
    # (outbox/_lifecycle.py, after_told); the request names this claim and is audited.
    [job_id] = seed(dsn, schema, {"key": "r1", "status": "running", "claim_version": 3})
    page = await client.get(f"/jobs/{job_id}")
    assert f'action="/jobs/{job_id}/cancel"' in page.text
    response = await client.post(f"/jobs/{job_id}/cancel", data=form(3), headers=SAME_ORIGIN)
    assert response.headers["location"].endswith("?outcome=told")
    row = job(dsn, schema, job_id)
    assert (row["status"], row["cancel_version"]) == ("running", 3)
    assert [entry["action"] for entry in audit(dsn, schema)] == ["cancel"]


async def test_a_cancel_of_a_claim_that_moved_on_changes_nothing(
        client: httpx.AsyncClient, dsn: str, schema: str) -> None:
    [job_id] = seed(dsn, schema, {"key": "r2", "status": "running", "claim_version": 4})
    await client.post(f"/jobs/{job_id}/cancel", data=form(3), headers=SAME_ORIGIN)
    assert job(dsn, schema, job_id)["cancel_version"] is None
    assert [entry["affected"] for entry in audit(dsn, schema)] == [0]  # tried, fenced out


async def test_resolving_reconcile_as_performed_writes_the_ledger_with_who_decided(
        client: httpx.AsyncClient, dsn: str, schema: str) -> None:
    [job_id] = seed(dsn, schema, {"key": "rc1", "status": "reconcile", "claim_version": 2})
    await client.post(f"/jobs/{job_id}/resolve_done", headers=SAME_ORIGIN,
                      data=form(2, note="charge ch_1 seen in the Stripe dashboard"))
    assert job(dsn, schema, job_id)["status"] == "done"
    row = ledger(dsn, schema, "rc1")
    assert row is not None and row["job_id"] == job_id and row["claim_version"] == 2
    assert row["result"] == {"resolved_by": "anonymous@127.0.0.1",
                             "note": "charge ch_1 seen in the Stripe dashboard"}
    [entry] = audit(dsn, schema)
    assert entry["action"] == "resolve_done"
    assert entry["detail"]["note"] == "charge ch_1 seen in the Stripe dashboard"


async def test_resolving_reconcile_as_not_performed_fails_it(
        client: httpx.AsyncClient, dsn: str, schema: str) -> None:
    [job_id] = seed(dsn, schema, {"key": "rc2", "status": "reconcile", "claim_version": 2,
                                  "last_error": "timeout after send"})
    await client.post(f"/jobs/{job_id}/resolve_failed", data=form(2), headers=SAME_ORIGIN)
    row = job(dsn, schema, job_id)
    assert row["status"] == "failed"
    assert row["last_error"].startswith("resolved as not performed by anonymous@127.0.0.1")
    assert ledger(dsn, schema, "rc2") is None


async def test_bulk_retry_asks_first_then_retries_only_matching_failed_jobs(
        client: httpx.AsyncClient, dsn: str, schema: str) -> None:
    ids = seed(dsn, schema,
               {"key": "b1", "status": "failed", "last_error": "HTTP 503"},
               {"key": "b2", "status": "failed", "last_error": "HTTP 503"},
               {"key": "b3", "status": "failed", "last_error": "bad address"},
               {"key": "b4", "status": "reconcile", "last_error": "HTTP 503"})
    asked = await client.post("/jobs/bulk-retry", data={"error": "503"}, headers=SAME_ORIGIN)
    assert "2 failed jobs will be sent back to pending." in asked.text
    assert [job(dsn, schema, i)["status"] for i in ids] == ["failed"] * 3 + ["reconcile"]
    done = await client.post("/jobs/bulk-retry", data={"error": "503", "confirm": "yes"},
                             headers=SAME_ORIGIN)
    assert "2 jobs sent back to pending." in done.text
    assert [job(dsn, schema, i)["status"] for i in ids] == [
        "pending", "pending", "failed", "reconcile"]
    [entry] = audit(dsn, schema)
    assert entry["action"] == "bulk_retry" and entry["affected"] == 2
    assert entry["detail"]["filter"] == {"status": "failed", "error": "503"}


@pytest.mark.parametrize("headers", [
    {"sec-fetch-site": "cross-site"},
    {"sec-fetch-site": "same-site"},
    {"origin": "https://evil.example"},
    {"origin": "null"},
    {},  # neither header, and no token
])
async def test_cross_site_posts_are_refused(
        client: httpx.AsyncClient, dsn: str, schema: str, headers: dict[str, str]) -> None:
    [job_id] = seed(dsn, schema, {"key": "x1", "status": "failed"})
    await client.get("/jobs")  # the browser holds the CSRF cookie
    response = await client.post(f"/jobs/{job_id}/retry", data=form(0, "failed"),
                                 headers=headers)
    assert response.status_code == 403
    assert job(dsn, schema, job_id)["status"] == "failed"
    assert audit(dsn, schema) == []


async def test_a_client_sending_no_fetch_headers_may_act_with_the_token(
        client: httpx.AsyncClient, dsn: str, schema: str) -> None:
    [job_id] = seed(dsn, schema, {"key": "x2", "status": "failed"})
    page = (await client.get(f"/jobs/{job_id}")).text
    match = re.search(r'name="csrf" value="([^"]+)"', page)
    assert match
    wrong = await client.post(f"/jobs/{job_id}/retry", data=form(0, "failed", csrf="forged"))
    assert wrong.status_code == 403
    right = await client.post(f"/jobs/{job_id}/retry", data=form(0, "failed", csrf=match[1]))
    assert right.status_code == 303
    assert job(dsn, schema, job_id)["status"] == "pending"


async def test_same_host_origin_is_accepted(
        client: httpx.AsyncClient, dsn: str, schema: str) -> None:
    [job_id] = seed(dsn, schema, {"key": "x3", "status": "failed"})
    response = await client.post(f"/jobs/{job_id}/retry", data=form(0, "failed"),
                                 headers={"origin": "http://testserver"})
    assert response.status_code == 303


async def test_actions_are_post_only(client: httpx.AsyncClient, dsn: str, schema: str) -> None:
    [job_id] = seed(dsn, schema, {"key": "x4", "status": "failed"})
    assert (await client.get(f"/jobs/{job_id}/retry")).status_code == 405
    assert (await client.get("/jobs/bulk-retry")).status_code == 405


async def test_read_only_mode_shows_no_buttons_and_refuses_actions(
        make_client: ClientFactory, dsn: str, schema: str) -> None:
    [job_id] = seed(dsn, schema, {"key": "ro1", "status": "failed"})
    client = await make_client(read_only=True)
    for path in ("/jobs", f"/jobs/{job_id}", "/jobs?status=failed"):
        page = (await client.get(path)).text
        assert "<button type=\"submit\">Retry" not in page and 'method="post"' not in page
    response = await client.post(f"/jobs/{job_id}/retry", data=form(0, "failed"),
                                 headers=SAME_ORIGIN)
    assert response.status_code == 403
    assert job(dsn, schema, job_id)["status"] == "failed"


async def test_a_read_only_database_makes_the_dashboard_read_only(
        make_client: ClientFactory, dsn: str, schema: str) -> None:
    [job_id] = seed(dsn, schema, {"key": "ro2", "status": "failed"})
    read_only_dsn = make_conninfo(dsn, options="-c default_transaction_read_only=on")
    client = await make_client(read_only_dsn)
    assert 'method="post"' not in (await client.get(f"/jobs/{job_id}")).text
    response = await client.post(f"/jobs/{job_id}/retry", data=form(0, "failed"),
                                 headers=SAME_ORIGIN)
    assert response.status_code == 403
    assert job(dsn, schema, job_id)["status"] == "failed"


async def test_basic_auth_challenges_and_checks_the_password(
        make_client: ClientFactory) -> None:
    client = await make_client(authorize=BasicAuth("s3cret"))
    missing = await client.get("/")
    assert missing.status_code == 401 and missing.headers["www-authenticate"].startswith("Basic")
    assert (await client.get("/", auth=("ada", "wrong"))).status_code == 401
    assert (await client.get("/", auth=("ada", "s3cret"))).status_code == 200
    assert (await client.get("/metrics")).status_code == 401


async def test_a_host_authorizer_can_grant_read_only_or_refuse(
        make_client: ClientFactory, dsn: str, schema: str) -> None:
    [job_id] = seed(dsn, schema, {"key": "h1", "status": "failed"})

    async def authorize(request: object) -> str | None:
        role = getattr(request, "headers", {}).get("x-role")
        return role if role in ("read", "operate") else None

    client = await make_client(authorize=authorize)
    assert (await client.get("/")).status_code == 403
    reader = {"x-role": "read", **SAME_ORIGIN}
    assert 'method="post"' not in (await client.get(f"/jobs/{job_id}", headers=reader)).text
    refused = await client.post(f"/jobs/{job_id}/retry", data=form(0, "failed"), headers=reader)
    assert refused.status_code == 403
    operator = {"x-role": "operate", **SAME_ORIGIN}
    allowed = await client.post(f"/jobs/{job_id}/retry", data=form(0, "failed"),
                                headers=operator)
    assert allowed.status_code == 303


async def test_a_role_that_cannot_update_the_jobs_gets_a_read_only_dashboard(
        make_client: ClientFactory, dsn: str, schema: str) -> None:
    [job_id] = seed(dsn, schema, {"key": "ro3", "status": "failed"})
    role = f"reader_{schema}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'CREATE ROLE "{role}" LOGIN')
        conn.execute(f'GRANT USAGE ON SCHEMA "{schema}" TO "{role}"')
        conn.execute(f'GRANT SELECT ON ALL TABLES IN SCHEMA "{schema}" TO "{role}"')
    try:
        client = await make_client(make_conninfo(dsn, user=role))
        page = (await client.get(f"/jobs/{job_id}")).text
        assert "Job " in page and 'method="post"' not in page
        response = await client.post(f"/jobs/{job_id}/retry", data=form(0, "failed"),
                                     headers=SAME_ORIGIN)
        assert response.status_code == 403
        await client.aclose()
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                         "WHERE usename = %s", (role,))
            conn.execute(f'DROP OWNED BY "{role}"')
            conn.execute(f'DROP ROLE "{role}"')
    assert job(dsn, schema, job_id)["status"] == "failed"
