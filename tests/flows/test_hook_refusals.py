"""A hooked outcome the database refuses costs only its own job (real PostgreSQL).

A trigger refuses one job's ``running -> done`` write (its first attempt), as a
constraint would: the chunk holding it is refused, written again one outcome per
transaction, and every other job is done at its first claim with its hook's row written
once; the refused one is left to its lease, rescued, and done at its second attempt.
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg
import pytest
from psycopg import sql

import outbox
from outbox import NewJob
from outbox.testing import jobs

from .shop import dispatch_once

EFFECT = "flow.refusable"
JOBS = 40  # more than one chunk of hooked outcomes
REFUSED = "row-7"


class Quick(outbox.Effect):
    """Done at once; its ``on_done`` hooks write one row per call."""

    name = EFFECT

    def __init__(self, schema: str) -> None:
        self.insert = sql.SQL("INSERT INTO {}.hooked VALUES (%s)").format(
            sql.Identifier(schema))

    def perform(self, job: outbox.Job) -> dict[str, int]:
        return {"n": 1}

    def record(self, tx: outbox.HookTransaction, job: outbox.Job, result: Any) -> None:
        tx.execute(self.insert, (job.key,))

    async def record_async(self, tx: outbox.AsyncHookTransaction, job: outbox.Job,
                           result: Any) -> None:
        await tx.execute(self.insert, (job.key,))


def prepare(dsn: str, schema: str) -> None:
    """The hook's table, and a trigger refusing ``REFUSED``'s first done write."""
    ident = sql.Identifier(schema)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE TABLE {}.hooked (key text NOT NULL)").format(ident))
        conn.execute(sql.SQL(
            "CREATE FUNCTION {}.refuse_done() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "IF NEW.status = 'done' AND NEW.key = {} AND OLD.attempts = 1 THEN "
            "RAISE EXCEPTION 'outcome refused' USING ERRCODE = 'P0001'; "
            "END IF; RETURN NEW; END $$").format(ident, sql.Literal(REFUSED)))
        conn.execute(sql.SQL(
            "CREATE TRIGGER refuse_done BEFORE UPDATE ON {}.jobs FOR EACH ROW "
            "EXECUTE FUNCTION {}.refuse_done()").format(ident, ident))


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_refused_hooked_outcome_costs_only_its_own_job(
    dsn: str, schema: str, flavour: str, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="outbox.dispatcher")
    prepare(dsn, schema)
    keys = [f"row-{n}" for n in range(JOBS)]
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue_many([NewJob(EFFECT, key, {}) for key in keys])
    effect = Quick(schema)
    options: dict[str, Any] = {"schema": schema, "lease": 1.0, "rescue_interval": 0.2,
                               "batch_size": JOBS, "prefetch": JOBS}
    hook = effect.record if flavour == "sync" else effect.record_async
    stats = dispatch_once(flavour, dsn, [effect], on_done={EFFECT: hook}, **options)

    with psycopg.connect(dsn, autocommit=True) as conn:
        found = jobs(conn, schema)
        hooked = [k for (k,) in conn.execute(sql.SQL("SELECT key FROM {}.hooked").format(
            sql.Identifier(schema)))]
    assert {k: (j["status"], j["claim_version"]) for k, j in found.items()} == {
        k: ("done", 2 if k == REFUSED else 1) for k in keys}
    assert sorted(hooked) == sorted(keys)  # each hook's row written once
    assert stats.rescued == 1 and stats.done == JOBS
    refusals = [m for m in caplog.messages if "recording one by one" in m]
    assert refusals and all("P0001" in m for m in refusals)  # the chunk went one by one
