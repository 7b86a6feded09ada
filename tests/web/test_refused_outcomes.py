"""Every attempt a dispatcher starts reaches its observer, whatever happens to the write
of its outcome: a database that refuses the write (a trigger raising, as a constraint or
a permission would) leaves ``outbox_jobs_in_flight`` at 0, not stuck at what was running.
"""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from psycopg import sql

import outbox
from outbox.metrics import PrometheusObserver

EFFECT = "test.refused"


class Quick(outbox.Effect):
    name = EFFECT

    def perform(self, job: outbox.Job) -> dict[str, int]:
        return {"n": 1}


def refuse_done(dsn: str, schema: str, errcode: str, *, first_attempt_only: bool) -> None:
    """A trigger that raises ``errcode`` on the running -> done write (of the first
    attempt only, if asked)."""
    condition = "NEW.status = 'done'" + (" AND OLD.attempts = 1" if first_attempt_only else "")
    ident = sql.Identifier(schema)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL(
            "CREATE FUNCTION {}.refuse_done() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "IF " + condition + " THEN RAISE EXCEPTION 'outcome refused' USING ERRCODE = {}; "
            "END IF; RETURN NEW; END $$").format(ident, sql.Literal(errcode)))
        conn.execute(sql.SQL(
            "CREATE TRIGGER refuse_done BEFORE UPDATE ON {}.jobs FOR EACH ROW "
            "EXECUTE FUNCTION {}.refuse_done()").format(ident, ident))


def enqueue(dsn: str, schema: str, count: int) -> None:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        for n in range(count):
            tx.enqueue(EFFECT, key=f"refused-{n}", payload={})


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            found[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return found


def attempts(got: dict[tuple[str, tuple[tuple[str, str], ...]], float], outcome: str) -> float:
    return got[("outbox_job_attempts_total", (("effect", EFFECT), ("outcome", outcome)))]


def in_flight(got: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> float:
    return got[("outbox_jobs_in_flight", (("effect", EFFECT),))]


@pytest.mark.parametrize("flavour", ["threads", "async"])
def test_a_refused_row_is_dropped_counted_and_later_done(
        dsn: str, schema: str, flavour: str) -> None:
    refuse_done(dsn, schema, "P0001", first_attempt_only=True)
    enqueue(dsn, schema, 2)
    registry = CollectorRegistry()
    options: dict[str, Any] = {"schema": schema, "lease": 1.0, "rescue_interval": 0.2,
               "observer": PrometheusObserver(registry)}
    if flavour == "threads":
        stats = outbox.Dispatcher(dsn, [Quick()], **options).run_until_idle(timeout=60)
    else:
        stats = asyncio.run(outbox.AsyncDispatcher(dsn, [Quick()], **options)
                            .run_until_idle(timeout=60))
    got = scrape(registry)
    assert in_flight(got) == 0
    # Each job: a first attempt whose outcome the database refused (reported as lost,
    # its lease left to expire), then a rescued second attempt recorded as done.
    assert (attempts(got, "lost"), attempts(got, "done")) == (2, 2)
    assert stats.rescued == 2 and stats.done == 2
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(sql.SQL("SELECT status, attempts FROM {}.jobs").format(
            sql.Identifier(schema))).fetchall()
    assert rows == [("done", 2), ("done", 2)]


@pytest.mark.parametrize("flavour", ["threads", "async"])
def test_a_refusal_that_stops_the_dispatcher_still_reaches_the_observer(
        dsn: str, schema: str, flavour: str) -> None:
    # 42501 is what a revoked privilege raises: no retry can help, the run stops.
    refuse_done(dsn, schema, "42501", first_attempt_only=False)
    enqueue(dsn, schema, 3)
    registry = CollectorRegistry()
    options: dict[str, Any] = {"schema": schema, "observer": PrometheusObserver(registry)}
    with pytest.raises(outbox.ConfigurationError, match="outcome refused"):
        if flavour == "threads":
            outbox.Dispatcher(dsn, [Quick()], **options).run_until_idle(timeout=60)
        else:
            asyncio.run(outbox.AsyncDispatcher(dsn, [Quick()], **options)
                        .run_until_idle(timeout=60))
    got = scrape(registry)
    assert in_flight(got) == 0
    assert attempts(got, "lost") == 3
    assert attempts(got, "done") == 0
