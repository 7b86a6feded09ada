"""Retention runs under ``run_until_idle()`` too, so cron deployments keep tables small."""

from __future__ import annotations

import asyncio
import threading
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

import outbox
from outbox import NewJob
from outbox.testing import jobs, ledger, received

from ..integration.helpers import wait_until


class Echo(outbox.Effect):
    name = "retained.echo"

    def perform(self, job: outbox.Job) -> dict[str, str]:
        return {"key": job.key}


def _done(dsn: str, schema: str, keys: list[str]) -> None:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue_many(NewJob(Echo.name, key, {}) for key in keys)
    assert outbox.Dispatcher(dsn, [Echo()], schema=schema).run_until_idle().done == len(keys)


def _age(dsn: str, schema: str, *, jobs_days: dict[str, int], ledger_days: dict[str, int]) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for key, days in jobs_days.items():
            conn.execute(sql.SQL("UPDATE {}.jobs SET updated_at = now() - make_interval(days => %s)"
                                 " WHERE key = %s").format(sql.Identifier(schema)), (days, key))
        for key, days in ledger_days.items():
            conn.execute(sql.SQL("UPDATE {}.effect_results SET recorded_at = now() - "
                                 "make_interval(days => %s) WHERE key = %s").format(
                                     sql.Identifier(schema)), (days, key))


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_run_until_idle_purges_old_done_jobs_and_ledger_rows(
    dsn: str, schema: str, flavour: str
) -> None:
    _done(dsn, schema, ["old", "older", "recent"])
    _age(dsn, schema, jobs_days={"old": 8, "older": 100}, ledger_days={"older": 100})
    week, quarter = 7 * 86400.0, 90 * 86400.0
    if flavour == "sync":
        stats = outbox.Dispatcher(dsn, [Echo()], schema=schema, retention=week,
                                  ledger_retention=quarter).run_until_idle()
    else:
        stats = asyncio.run(outbox.AsyncDispatcher(
            dsn, [Echo()], schema=schema, retention=week, ledger_retention=quarter,
        ).run_until_idle())
    assert stats.purged == 3  # two done jobs, one ledger row
    assert set(jobs(dsn, schema)) == {"recent"}
    assert set(ledger(dsn, schema)) == {"old", "recent"}  # the ledger outlives its jobs


def test_retention_none_keeps_everything(dsn: str, schema: str) -> None:
    _done(dsn, schema, ["old"])
    _age(dsn, schema, jobs_days={"old": 400}, ledger_days={"old": 400})
    dispatcher = outbox.Dispatcher(dsn, [Echo()], schema=schema, retention=None,
                                   ledger_retention=None)
    assert dispatcher.run_until_idle().purged == 0
    assert set(jobs(dsn, schema)) == {"old"} and set(ledger(dsn, schema)) == {"old"}


def _receive(dsn: str, schema: str, *, days: dict[str, float]) -> None:
    """Inbox rows through ``tx.receive``, then received ``days`` ago."""
    with psycopg.connect(dsn) as conn:
        for message_id in days:
            with outbox.transaction(conn, schema=schema) as tx:
                assert tx.receive("billing", message_id)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for message_id, ago in days.items():
            conn.execute(sql.SQL("UPDATE {}.inbox SET received_at = now() - "
                                 "make_interval(secs => %s) WHERE message_id = %s").format(
                                     sql.Identifier(schema)), (ago * 86400, message_id))


def _inbox(dsn: str, schema: str) -> set[str]:
    return set(received(dsn, "billing", schema))  # every row here is billing's


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_run_until_idle_purges_old_inbox_rows_and_keeps_recent_ones(
    dsn: str, schema: str, flavour: str
) -> None:
    _receive(dsn, schema, days={"old": 8, "older": 400, "recent": 6.5, "new": 0})
    options: dict[str, Any] = {"schema": schema, "inbox_retention": 7 * 86400.0}
    if flavour == "sync":
        stats = outbox.Dispatcher(dsn, [Echo()], **options).run_until_idle()
    else:
        stats = asyncio.run(outbox.AsyncDispatcher(dsn, [Echo()], **options).run_until_idle())
    assert stats.purged == 2
    assert _inbox(dsn, schema) == {"recent", "new"}
    # A purged message counts as new again: the retention is the inbox's memory.
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        assert tx.receive("billing", "old") and not tx.receive("billing", "recent")


def test_the_inbox_is_purged_by_run_in_batches(dsn: str, schema: str) -> None:
    old = 2500  # more than two batches of 1000: the round repeats while batches fill
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL(
            "INSERT INTO {}.inbox (consumer, message_id, received_at) "
            "SELECT 'billing', 'old-' || i, now() - interval '2 days' "
            "FROM generate_series(1, %s) i").format(sql.Identifier(schema)), (old,))
    _receive(dsn, schema, days={"recent": 0.5})
    dispatcher = outbox.Dispatcher(dsn, [Echo()], schema=schema, inbox_retention=timedelta(days=1))
    result: list[outbox.DispatchStats] = []
    thread = threading.Thread(target=lambda: result.append(dispatcher.run()))
    thread.start()
    try:
        wait_until(lambda: _inbox(dsn, schema) == {"recent"}, what="the inbox purge")
    finally:
        dispatcher.stop()
        thread.join(30)
    assert result[0].purged == old


def test_inbox_retention_none_keeps_the_inbox(dsn: str, schema: str) -> None:
    _receive(dsn, schema, days={"ancient": 4000})
    stats = outbox.Dispatcher(dsn, [Echo()], schema=schema, inbox_retention=None).run_until_idle()
    assert stats.purged == 0
    assert _inbox(dsn, schema) == {"ancient"}
