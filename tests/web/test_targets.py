"""One dashboard over several outboxes: create_app(targets=[...]) and `outbox web --target`.

Two migrated schemas of the test database (A and B, whose first jobs share id 1), a schema
never migrated (M) and a database out of reach (D), every DSN carrying a password that
must appear in no page and no header.
"""

from __future__ import annotations

import html
import re
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, MutableMapping
from typing import Any
from urllib.parse import quote

import httpx
import psycopg
import pytest
from click.testing import CliRunner
from psycopg import sql
from psycopg.conninfo import make_conninfo
from starlette.applications import Starlette
from starlette.routing import Mount

from outbox import Target
from outbox.errors import ConfigurationError
from outbox.testing import create_schema, drop_schema
from outbox.web import app as web_app
from outbox.web import create_app
from outbox.web import target_slug as slug_of
from outbox.web import target_slugs as slugs

from .conftest import SAME_ORIGIN
from .support import audit, job, seed

pytestmark = pytest.mark.anyio

SECRET = "pw-Secret-7d1f"  # in every DSN: never in a page
UNREACHABLE = f"postgresql://outbox:{SECRET}@127.0.0.1:1/nowhere"  # nothing listens on 1


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def keyed(dsn: str) -> str:
    """The test database's DSN with a password (the server trusts local connections)."""
    return make_conninfo(dsn, password=SECRET)


@pytest.fixture
def second(dsn: str) -> Iterator[str]:
    name = create_schema(dsn)
    yield name
    drop_schema(dsn, name)


@pytest.fixture
def fleet(keyed: str, schema: str, second: str) -> dict[str, Target]:
    return {"A": Target(keyed, schema), "B": Target(keyed, second),
            "M": Target(keyed, f"never_{uuid.uuid4().hex[:8]}"),
            "D": Target(UNREACHABLE, "outbox")}


def slug(target: Target) -> str:
    return slug_of(target)


@pytest.fixture
async def make_client() -> AsyncIterator[Callable[..., Any]]:
    opened: list[tuple[Starlette, httpx.AsyncClient]] = []

    async def make(app: Starlette | None = None, **options: Any) -> httpx.AsyncClient:
        app = app or create_app(**options)
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                   base_url="http://testserver")
        opened.append((app, client))
        return client

    yield make
    for app, client in opened:
        await client.aclose()
        state = getattr(app.state, "outbox", None)
        if state is not None:
            await state.close()


@pytest.fixture
async def client(make_client: Callable[..., Any], fleet: dict[str, Target]) -> httpx.AsyncClient:
    made: httpx.AsyncClient = await make_client(targets=list(fleet.values()))
    return made


def picker(page: str) -> list[str]:
    found = re.search(r'<form class="picker".*?</form>', page, re.DOTALL)
    assert found, "no target picker"
    return re.findall(r'<option value="([^"]*)"', found[0])


def selected(page: str) -> str | None:
    found = re.search(r'<option value="([^"]+)" selected>', page)
    return found[1] if found else None


def keys(page: str) -> set[str]:
    return set(re.findall(r'<td class="key">([^<]*)</td>', page))


async def raw_get(client: httpx.AsyncClient, path: str) -> tuple[int, str]:
    """GET ``path`` as the ASGI app would receive it, dots and all (httpx resolves them)."""
    transport = client._transport
    assert isinstance(transport, httpx.ASGITransport)
    sent: list[MutableMapping[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    await transport.app({
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
        "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
        "query_string": b"", "headers": [(b"host", b"testserver")],
        "client": ("127.0.0.1", 1234), "server": ("testserver", 80)}, receive, send)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], body.decode()


def no_secret(response: httpx.Response) -> None:
    assert SECRET not in response.text
    assert all(SECRET not in value for value in response.headers.values())
    assert "postgresql://" not in response.text


async def test_the_targets_page_shows_each_target_up_with_its_backlog_or_why_not(
        client: httpx.AsyncClient, fleet: dict[str, Target], dsn: str) -> None:
    seed(dsn, fleet["A"].schema, {"key": "a1"}, {"key": "a2"}, {"key": "a3", "status": "failed"})
    seed(dsn, fleet["B"].schema, {"key": "b1"})
    response = await client.get("/")
    assert response.status_code == 200
    no_secret(response)
    rows = dict(re.findall(r'<tr class="(?:up|down)"><td><a href="/t/([^"]+)/">(.*?)</tr>',
                           response.text, re.DOTALL))
    assert set(rows) == {slug(t) for t in fleet.values()}
    assert '>up<' in rows[slug(fleet["A"])] and '>2</a>' in rows[slug(fleet["A"])]
    assert '>up<' in rows[slug(fleet["B"])] and '>1</a>' in rows[slug(fleet["B"])]
    assert "has no outbox tables" in rows[slug(fleet["M"])]
    assert "unreachable: host 127.0.0.1 port 1" in rows[slug(fleet["D"])]
    for target in fleet.values():
        assert target.name in response.text
    assert picker(response.text) == ["", *(slug(t) for t in fleet.values())]


async def test_every_page_of_a_target_has_the_picker_with_it_chosen(
        client: httpx.AsyncClient, fleet: dict[str, Target], dsn: str) -> None:
    [job_id] = seed(dsn, fleet["B"].schema, {"key": "b1", "status": "failed"})
    b = slug(fleet["B"])
    for path in ("/", "/jobs", "/jobs?status=failed", f"/jobs/{job_id}", "/jobs/999999"):
        response = await client.get(f"/t/{b}{path}")
        assert response.status_code in (200, 404), (path, response.text)
        assert picker(response.text) == [slug(t) for t in fleet.values()], path
        assert selected(response.text) == b, path
        assert f'href="/t/{b}/jobs"' in response.text  # the nav stays on the target
        assert 'href="/static/style.css"' in response.text
        no_secret(response)
    page = (await client.get(f"/t/{b}/jobs?status=failed")).text
    assert '<input type="hidden" name="page" value="jobs">' in page
    assert '<input type="hidden" name="status" value="failed">' in page


async def test_the_picker_opens_the_chosen_target(
        client: httpx.AsyncClient, fleet: dict[str, Target]) -> None:
    a = slug(fleet["A"])
    response = await client.get("/pick", params={"target": a})
    assert (response.status_code, response.headers["location"]) == (303, f"/t/{a}/")
    response = await client.get("/pick", params={"target": a, "page": "jobs",
                                                  "status": "failed"})
    assert response.headers["location"] == f"/t/{a}/jobs?status=failed"
    response = await client.get("/pick", params={"target": a, "page": "jobs",
                                                  "status": "<script>"})
    assert response.headers["location"] == f"/t/{a}/jobs"
    response = await client.get("/pick", params={"target": "<script>x</script>"})
    assert response.status_code == 404 and "<script>x" not in response.text


async def test_each_target_shows_its_own_jobs(
        client: httpx.AsyncClient, fleet: dict[str, Target], dsn: str) -> None:
    seed(dsn, fleet["A"].schema, {"key": "only-in-a"})
    seed(dsn, fleet["B"].schema, {"key": "only-in-b", "status": "failed"})
    assert keys((await client.get(f"/t/{slug(fleet['A'])}/jobs")).text) == {"only-in-a"}
    assert keys((await client.get(f"/t/{slug(fleet['B'])}/jobs")).text) == {"only-in-b"}
    overview = (await client.get(f"/t/{slug(fleet['B'])}/")).text
    assert re.search(r'status-failed" href="[^"]*">\s*<span class="n">1<', overview)
    assert re.search(r'status-pending" href="[^"]*">\s*<span class="n">0<', overview)


async def test_a_retry_acts_on_the_chosen_target_only(
        client: httpx.AsyncClient, fleet: dict[str, Target], dsn: str) -> None:
    a, b = fleet["A"].schema, fleet["B"].schema
    [in_a] = seed(dsn, a, {"key": "fa", "status": "failed", "claim_version": 2})
    [in_b] = seed(dsn, b, {"key": "fb", "status": "failed", "claim_version": 2})
    assert in_a == in_b  # fresh schemas: the same id names a job in each
    response = await client.post(f"/t/{slug(fleet['B'])}/jobs/{in_b}/retry",
                                 data={"claim_version": "2", "status": "failed"},
                                 headers=SAME_ORIGIN)
    assert response.status_code == 303
    assert response.headers["location"] == f"/t/{slug(fleet['B'])}/jobs/{in_b}?outcome=retried"
    assert job(dsn, b, in_b)["status"] == "pending"
    assert job(dsn, a, in_a)["status"] == "failed"
    assert [(e["action"], e["affected"]) for e in audit(dsn, b)] == [("retry", 1)]
    assert audit(dsn, a) == []
    page = (await client.get(response.headers["location"])).text
    assert "Job sent back to pending." in page and selected(page) == slug(fleet["B"])


async def test_a_pause_acts_on_the_chosen_target_only(
        client: httpx.AsyncClient, fleet: dict[str, Target], dsn: str) -> None:
    response = await client.post(f"/t/{slug(fleet['A'])}/effects/pause",
                                 data={"effect": "email.send", "minutes": "5"},
                                 headers=SAME_ORIGIN)
    assert (response.status_code, response.headers["location"]) == (
        303, f"/t/{slug(fleet['A'])}/")

    def paused(schema: str) -> list[str]:
        with psycopg.connect(dsn, autocommit=True) as conn:
            return [r[0] for r in conn.execute(sql.SQL(
                "SELECT effect FROM {}.effect_limits WHERE paused_until > now()").format(
                sql.Identifier(schema))).fetchall()]

    assert paused(fleet["A"].schema) == ["email.send"]
    assert paused(fleet["B"].schema) == []


async def test_actions_keep_their_csrf_and_read_only_rules(
        client: httpx.AsyncClient, make_client: Callable[..., Any],
        fleet: dict[str, Target], dsn: str) -> None:
    [job_id] = seed(dsn, fleet["A"].schema, {"key": "f", "status": "failed"})
    url = f"/t/{slug(fleet['A'])}/jobs/{job_id}/retry"
    form = {"claim_version": "0", "status": "failed"}
    response = await client.post(url, data=form, headers={"sec-fetch-site": "cross-site"})
    assert response.status_code == 403
    response = await client.post(url, data=form)  # no header, no CSRF token
    assert response.status_code == 403
    token = (await client.get(f"/t/{slug(fleet['A'])}/jobs")).cookies.get("outbox_csrf")
    assert token, "the CSRF cookie is set for the whole dashboard"
    read_only = await make_client(targets=list(fleet.values()), read_only=True)
    response = await read_only.post(url, data=form, headers=SAME_ORIGIN)
    assert response.status_code == 403
    assert "Retry" not in (await read_only.get(f"/t/{slug(fleet['A'])}/jobs")).text
    assert job(dsn, fleet["A"].schema, job_id)["status"] == "failed"
    assert audit(dsn, fleet["A"].schema) == []


async def test_an_unknown_target_is_a_404_that_echoes_nothing(
        client: httpx.AsyncClient, fleet: dict[str, Target]) -> None:
    hostile = ["nope", "0", "1", "-1", "99999999999999999999", "%2e%2e", ".%2e",
               "..%2F..%2Fetc%2Fpasswd", "a%2Fb", "%3Cscript%3Ealert(1)%3C%2Fscript%3E",
               quote(UNREACHABLE, safe=""), quote(f"{fleet['A'].name}", safe=""),
               slug(fleet["A"]) + "x", slug(fleet["A"]).upper(), "%00", "~"]
    for text in hostile:
        for path in (f"/t/{text}/", f"/t/{text}/jobs", f"/t/{text}/jobs/1", f"/t/{text}"):
            response = await client.get(path)
            assert response.status_code == 404, (path, response.status_code)
            assert "No such target" in response.text, path
            assert "script" not in response.text.split("<main>")[1], path
            assert "passwd" not in response.text and "alert" not in response.text
            no_secret(response)
        response = await client.post(f"/t/{text}/jobs/1/retry", data={"claim_version": "0"},
                                     headers=SAME_ORIGIN)
        assert response.status_code == 404
    response = await client.get("/t/")
    assert response.status_code == 404 and "No such target" in response.text
    for raw in ("/t/../", "/t/../jobs", "/t/./jobs", "/t/%2e%2e/jobs"):  # as sent, unresolved
        status, body = await raw_get(client, raw)
        assert status == 404 and "No such target" in body, raw
    # Its slash missing, a known target is redirected to.
    response = await client.get(f"/t/{slug(fleet['A'])}")
    assert response.headers["location"] == f"/t/{slug(fleet['A'])}/"


async def test_a_schema_never_migrated_shows_its_name_and_why(
        client: httpx.AsyncClient, fleet: dict[str, Target]) -> None:
    m = slug(fleet["M"])
    for path in ("/", "/jobs", "/jobs/1"):
        response = await client.get(f"/t/{m}{path}")
        assert response.status_code == 503
        assert fleet["M"].name in response.text
        assert "has no outbox tables: run `outbox migrate`" in response.text
        assert selected(response.text) == m
        no_secret(response)
    response = await client.post(f"/t/{m}/jobs/1/retry", data={"claim_version": "0"},
                                 headers=SAME_ORIGIN)
    assert response.status_code == 503
    assert (await client.get(f"/t/{slug(fleet['A'])}/jobs")).status_code == 200


async def test_a_database_out_of_reach_shows_why_and_the_others_go_on(
        client: httpx.AsyncClient, fleet: dict[str, Target]) -> None:
    d = slug(fleet["D"])
    response = await client.get(f"/t/{d}/")
    assert response.status_code == 503
    assert f"{fleet['D'].name} cannot be shown" in response.text
    assert "unreachable: host 127.0.0.1 port 1" in response.text
    no_secret(response)
    for name in ("A", "B"):
        assert (await client.get(f"/t/{slug(fleet[name])}/")).status_code == 200


async def test_a_target_dropped_while_shown_answers_its_page_not_a_500(
        make_client: Callable[..., Any], keyed: str, dsn: str, schema: str) -> None:
    doomed = create_schema(dsn)
    client = await make_client(targets=[Target(keyed, schema), Target(keyed, doomed)])
    url = f"/t/{slug(Target(keyed, doomed))}/jobs"
    assert (await client.get(url)).status_code == 200
    drop_schema(dsn, doomed)
    response = await client.get(url)
    assert response.status_code == 503
    assert f"schema {doomed!r} has no outbox tables or is older" in html.unescape(
        response.text)
    create_schema(dsn, doomed)  # migrated again: shown again
    try:
        assert (await client.get(url)).status_code == 200
    finally:
        drop_schema(dsn, doomed)


async def test_no_page_shows_a_password(client: httpx.AsyncClient,
                                        fleet: dict[str, Target], dsn: str) -> None:
    seed(dsn, fleet["A"].schema, {"key": "k", "status": "failed", "last_error": "boom"})
    paths = ["/", "/pick?target=x", "/t/x/"]
    for target in fleet.values():
        base = f"/t/{slug(target)}"
        paths += [f"{base}/", f"{base}/jobs", f"{base}/jobs?status=failed", f"{base}/jobs/1",
                  f"{base}/metrics"]
    for path in paths:
        no_secret(await client.get(path))


async def test_one_target_shows_no_picker(make_client: Callable[..., Any],
                                          fleet: dict[str, Target]) -> None:
    client = await make_client(targets=[fleet["A"]])
    response = await client.get("/")
    assert (response.status_code, response.headers["location"]) == (
        303, f"/t/{slug(fleet['A'])}/")
    page = (await client.get(response.headers["location"])).text
    assert 'class="picker"' not in page and "picker.js" not in page
    assert f'<span class="target">{fleet["A"].name}</span>' in page


async def test_the_single_outbox_form_has_no_picker(make_client: Callable[..., Any],
                                                    dsn: str, schema: str) -> None:
    client = await make_client(create_app(dsn, schema=schema))
    page = (await client.get("/")).text
    assert 'class="picker"' not in page and 'class="target"' not in page
    assert '<a href="/jobs">Jobs</a>' in page and 'href="/static/style.css"' in page


async def test_a_targets_function_is_read_again(
        make_client: Callable[..., Any], fleet: dict[str, Target],
        monkeypatch: pytest.MonkeyPatch) -> None:
    given = [fleet["A"]]
    calls: list[int] = []

    def targets() -> list[Target]:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError(f"cannot list tenants of {UNREACHABLE}")
        return list(given)

    client = await make_client(targets=targets)
    assert (await client.get("/")).status_code == 303  # one target: opened at once
    monkeypatch.setattr(web_app, "TARGETS_TTL", 0.0)
    given.append(fleet["B"])
    page = (await client.get(f"/t/{slug(fleet['A'])}/")).text
    assert picker(page) == [slug(fleet["A"]), slug(fleet["B"])]
    page = (await client.get(f"/t/{slug(fleet['B'])}/")).text  # the third read fails:
    assert picker(page) == [slug(fleet["A"]), slug(fleet["B"])]  # the last list is kept
    given.remove(fleet["A"])
    response = await client.get(f"/t/{slug(fleet['A'])}/")
    assert response.status_code == 404


async def test_a_targets_function_failing_at_first_answers_a_page_without_its_message(
        make_client: Callable[..., Any]) -> None:
    def targets() -> list[Target]:
        raise RuntimeError(f"cannot list tenants of {UNREACHABLE}")

    client = await make_client(targets=targets)
    for path in ("/", "/t/x/jobs", "/pick?target=x"):
        response = await client.get(path)
        assert response.status_code == 503
        assert "The targets cannot be read" in response.text and "RuntimeError" in response.text
        no_secret(response)


async def test_the_targets_must_be_targets(keyed: str) -> None:
    with pytest.raises(ConfigurationError, match="not both"):
        create_app(keyed, targets=[Target(keyed)])
    with pytest.raises(ConfigurationError, match="outbox.Target values"):
        create_app(targets=[keyed])  # type: ignore[list-item]
    with pytest.raises(ConfigurationError, match="a list of outbox.Target"):
        create_app(targets=keyed)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="needs a connection string"):
        create_app()


async def test_mounted_under_a_prefix_every_link_keeps_it(
        make_client: Callable[..., Any], fleet: dict[str, Target], dsn: str) -> None:
    inner = create_app(targets=[fleet["A"], fleet["B"]])
    client = await make_client(Starlette(routes=[Mount("/ops/outbox", inner)]))
    [job_id] = seed(dsn, fleet["B"].schema, {"key": "f", "status": "failed"})
    b = slug(fleet["B"])
    page = (await client.get(f"/ops/outbox/t/{b}/jobs")).text
    assert 'action="/ops/outbox/pick"' in page
    assert f'href="/ops/outbox/t/{b}/jobs/{job_id}"' in page
    assert 'href="/ops/outbox/static/style.css"' in page
    response = await client.get("/ops/outbox/pick", params={"target": b})
    assert response.headers["location"] == f"/ops/outbox/t/{b}/"
    response = await client.post(f"/ops/outbox/t/{b}/jobs/{job_id}/retry",
                                 data={"claim_version": "0", "status": "failed"},
                                 headers=SAME_ORIGIN)
    assert response.headers["location"] == f"/ops/outbox/t/{b}/jobs/{job_id}?outcome=retried"
    assert job(dsn, fleet["B"].schema, job_id)["status"] == "pending"
    await inner.state.outbox.close()


async def test_an_authorizer_sees_the_chosen_target(
        make_client: Callable[..., Any], fleet: dict[str, Target]) -> None:
    def authorize(request: Any) -> str | None:
        chosen = request.scope.get("outbox.target")
        return "read" if chosen is None or chosen == fleet["A"] else None

    client = await make_client(targets=list(fleet.values()), authorize=authorize)
    assert (await client.get(f"/t/{slug(fleet['A'])}/jobs")).status_code == 200
    assert (await client.get(f"/t/{slug(fleet['B'])}/jobs")).status_code == 403
    # Refused before the target is looked for: the unknown and the known alike.
    response = await make_client(targets=list(fleet.values()), authorize=lambda r: None)
    for path in ("/", "/t/nope/", f"/t/{slug(fleet['A'])}/", "/pick?target=nope"):
        refused = await response.get(path)
        assert refused.status_code == 403 and fleet["A"].name not in refused.text


def test_slugs_are_url_safe_stable_and_distinct() -> None:
    plain = Target("host=db1 port=5432 dbname=shop user=u password=p", "tenant_a")
    assert slug_of(plain) == "shop@db1:5432~tenant_a"
    socket = Target("host=/var/run/postgresql dbname=shop", "tenant a")
    odd = Target("host=/var/run/postgresql dbname=shop", "tenant-a")
    for target in (socket, odd):
        assert re.fullmatch(r"[A-Za-z0-9._@:~-]+", slug_of(target))
    assert slug_of(socket) != slug_of(odd)
    assert slug_of(socket) == slug_of(Target("host=/var/run/postgresql dbname=shop", "tenant a"))
    same_name = Target("host=db1 port=5432 dbname=shop user=other", "tenant_a")
    assert slugs([plain, same_name]) == ["shop@db1:5432~tenant_a", "shop@db1:5432~tenant_a~2"]


def test_the_web_command_takes_targets(monkeypatch: pytest.MonkeyPatch) -> None:
    from outbox import cli
    from outbox.web import _serve

    served: list[dict[str, Any]] = []
    monkeypatch.setattr(_serve, "serve", lambda dsn, **options: served.append(
        {"dsn": dsn, **options}))
    monkeypatch.delenv("OUTBOX_DATABASE_URL", raising=False)
    runner = CliRunner()
    result = runner.invoke(cli.main, ["web", "--target", "dbname=a#t1",
                                      "--target", "dbname=b"])
    assert result.exit_code == 0, result.output
    assert served[-1]["dsn"] is None
    assert served[-1]["targets"] == [Target("dbname=a", "t1"), Target("dbname=b", "outbox")]
    result = runner.invoke(cli.main, ["web", "--targets", "tests.web.test_targets:listed"])
    assert result.exit_code == 0, result.output
    assert served[-1]["targets"] is listed
    # The environment's DSN does not get in the way of --target; a given one does.
    result = runner.invoke(cli.main, ["web", "--target", "dbname=a"],
                           env={"OUTBOX_DATABASE_URL": "dbname=x"})
    assert result.exit_code == 0, result.output
    for args in (["--dsn", "dbname=x", "--target", "dbname=a"],
                 ["--schema", "s", "--target", "dbname=a"],
                 ["--target", "dbname=a", "--targets", "tests.web.test_targets:listed"]):
        result = runner.invoke(cli.main, ["web", *args])
        assert result.exit_code == 2 and "not both" in result.output, result.output
    result = runner.invoke(cli.main, ["web"])
    assert result.exit_code == 2 and "--dsn" in result.output


def listed() -> list[Target]:
    """A targets function for the command's test."""
    return [Target("dbname=a")]
