"""The dashboard's schedules page: the list, pause and resume (audited), refusals."""

from __future__ import annotations

import httpx
import pytest
from click.testing import CliRunner

from outbox.cli import main
from tests.web.conftest import SAME_ORIGIN, ClientFactory
from tests.web.support import audit

from .support import EFFECT

pytestmark = pytest.mark.anyio


def add(dsn: str, schema: str, name: str) -> None:
    result = CliRunner().invoke(main, ["schedules", "--dsn", dsn, "--schema", schema, "add",
                                       name, "--effect", EFFECT, "--cron", "0 3 * * *",
                                       "--timezone", "Europe/Berlin"])
    assert result.exit_code == 0, result.output


async def test_the_page_lists_schedules_and_pauses_and_resumes_them(
        client: httpx.AsyncClient, dsn: str, schema: str) -> None:
    assert "No schedules" in (await client.get("/schedules")).text
    add(dsn, schema, "nightly")
    page = (await client.get("/schedules")).text
    assert "<td>nightly</td><td>sched.record</td><td>cron 0 3 * * * Europe/Berlin</td>" \
           "<td>stored</td>" in page
    assert "<button>Pause</button>" in page and "never" in page
    paused = await client.post("/schedules/pause", data={"name": "nightly"},
                               headers=SAME_ORIGIN)
    assert paused.status_code == 303
    page = (await client.get(paused.headers["location"])).text
    assert "nightly paused" in page and "<strong>paused</strong>" in page
    await client.post("/schedules/resume", data={"name": "nightly"}, headers=SAME_ORIGIN)
    assert "<button>Pause</button>" in (await client.get("/schedules")).text
    actions = [(e["action"], e["actor"], e["detail"]["via"], e["affected"])
               for e in audit(dsn, schema)]
    assert actions[1:] == [("schedule_pause", "anonymous@127.0.0.1", "dashboard", 1),
                           ("schedule_resume", "anonymous@127.0.0.1", "dashboard", 1)]


async def test_actions_are_refused_cross_site_read_only_and_for_unknown_schedules(
        client: httpx.AsyncClient, make_client: ClientFactory, dsn: str, schema: str) -> None:
    add(dsn, schema, "nightly")
    refused = await client.post("/schedules/pause", data={"name": "nightly"},
                                headers={"sec-fetch-site": "cross-site"})
    assert refused.status_code == 403
    missing = await client.post("/schedules/pause", data={"name": "nope"}, headers=SAME_ORIGIN)
    assert missing.status_code == 404
    unknown = await client.post("/schedules/stop", data={"name": "nightly"},
                                headers=SAME_ORIGIN)
    assert unknown.status_code == 404
    reader = await make_client(read_only=True)
    assert "<button>Pause</button>" not in (await reader.get("/schedules")).text
    assert (await reader.post("/schedules/pause", data={"name": "nightly"},
                              headers=SAME_ORIGIN)).status_code == 403
    assert [e["action"] for e in audit(dsn, schema)] == ["schedule_add"]
