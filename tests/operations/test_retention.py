"""Retention runs under ``run_until_idle()`` too, so cron deployments keep tables small."""

from __future__ import annotations

import asyncio

import psycopg
import pytest
from psycopg import sql

import outbox
from outbox import NewJob
from outbox.testing import jobs, ledger


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
