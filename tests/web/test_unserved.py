"""The overview flags an effect whose due jobs no running dispatcher handles (a misspelt
effect name, a dispatcher not deployed), naming the served effect closest to it."""

from __future__ import annotations

import re
import threading
import time

import anyio
import httpx
import psycopg
import pytest
from psycopg import sql

import outbox
from outbox import Dispatcher, Effect, Job

pytestmark = pytest.mark.anyio


class Send(Effect):
    name = "email.send"

    def perform(self, job: Job) -> None:
        return None


def _enqueue(dsn: str, schema: str, effect: str, key: str) -> None:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue(effect, key=key, payload={})


def _live(dsn: str, schema: str, worker: str) -> bool:
    with psycopg.connect(dsn) as conn:
        found = conn.execute(sql.SQL("SELECT 1 FROM {}.dispatchers WHERE worker_id = %s "
                                     "AND expires_at > now()").format(sql.Identifier(schema)),
                             [worker]).fetchone()
    return found is not None


def _row(page: str, effect: str) -> str:
    start = page.index(f">{effect}</a>")
    return page[start:page.index("</tr>", start)]


async def test_the_overview_flags_an_unserved_effect_and_says_did_you_mean(
        client: httpx.AsyncClient, dsn: str, schema: str) -> None:
    _enqueue(dsn, schema, "email.sned", "typo-1")
    _enqueue(dsn, schema, "email.send", "ok-1")

    alone = (await client.get("/")).text  # nothing runs: flagged, no name to offer
    assert "no running dispatcher handles this effect" in _row(alone, "email.sned")
    assert "did you mean" not in alone

    dispatcher = Dispatcher(dsn, [Send()], schema=schema, poll_interval=0.2)
    thread = threading.Thread(target=dispatcher.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not _live(dsn, schema, dispatcher.worker_id):  # its heartbeat row
            assert time.monotonic() < deadline, "no heartbeat row within 30 s"
            await anyio.sleep(0.05)
        page = (await client.get("/")).text
    finally:
        dispatcher.stop()
        thread.join(30)
    flagged = re.sub(r"\s+", " ", _row(page, "email.sned"))
    assert ("no running dispatcher handles this effect; did you mean <code>email.send</code>?"
            in flagged), flagged
    assert "no running dispatcher" not in _row(page, "email.send")
