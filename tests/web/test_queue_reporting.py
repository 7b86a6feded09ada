"""What the queue's surfaces report is true: "due" is what a claim would take (ordering
keys respected), per-effect gauges read 0 instead of vanishing, and a database that
cannot be read is reported as such instead of failing the scrape."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import httpx
import psycopg
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from psycopg import sql

import outbox.sql
from outbox import _queue
from outbox.metrics import DatabaseCollector

from .support import seed

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(collector: DatabaseCollector) -> Samples:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    found = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            found[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return found


def oldest_due(got: Samples, effect: str) -> float:
    return got[("outbox_oldest_due_job_age_seconds", (("effect", effect),))]


def seed_held_back(dsn: str, schema: str) -> None:
    """Jobs due by their time but held back by an ordering key, and one truly due."""
    now = datetime.now(UTC)
    long_ago = now - timedelta(seconds=900)
    seed(dsn, schema,
         # order-7: the first job is retrying in an hour; the second waits behind it.
         {"key": "o7-1", "ordering_key": "order-7", "attempts": 1, "claim_version": 1,
          "available_at": now + timedelta(hours=1), "created_at": long_ago},
         {"key": "o7-2", "ordering_key": "order-7", "available_at": long_ago},
         # order-8: the first job is running; the second waits behind it.
         {"key": "o8-1", "ordering_key": "order-8", "status": "running"},
         {"key": "o8-2", "ordering_key": "order-8", "available_at": long_ago},
         # order-9: the first job is due; the second waits behind it (not due).
         {"key": "o9-1", "ordering_key": "order-9",
          "available_at": now - timedelta(seconds=60)},
         {"key": "o9-2", "ordering_key": "order-9", "available_at": long_ago},
         # order-6: earlier jobs are finished; this one is due.
         {"key": "o6-1", "ordering_key": "order-6", "status": "failed"},
         {"key": "o6-2", "ordering_key": "order-6",
          "available_at": now - timedelta(seconds=30)},
         {"key": "plain", "effect": "charge.card", "available_at": now - timedelta(seconds=5)})


def test_a_job_held_back_by_its_ordering_key_is_not_due(dsn: str, schema: str) -> None:
    seed_held_back(dsn, schema)
    got = scrape(DatabaseCollector(dsn, schema))
    # o9-1 (60 s) is the oldest job a claim would take; the 900 s ones wait for key-mates.
    assert 60 <= oldest_due(got, "email.send") < 120
    assert 5 <= oldest_due(got, "charge.card") < 60


def test_the_oldest_due_job_is_the_oldest_a_claim_takes(dsn: str, schema: str) -> None:
    seed_held_back(dsn, schema)
    with psycopg.connect(dsn) as conn:
        snapshot = _queue.read(conn, schema)
        # The dispatcher's own claim, for every effect, rolled back: what it would take.
        claimed = conn.execute(outbox.sql.queries(schema).claim, {
            "effects": ["email.send", "charge.card"], "limit": 1000, "lease": 30.0,
            "worker": "probe", "after": "{}"}).fetchall()
        conn.rollback()
    assert sorted(row[2] for row in claimed) == ["o6-2", "o9-1", "plain"]
    oldest_wait: dict[str, float] = {}
    for row in claimed:  # row[9]: how long the job had been due when claimed
        oldest_wait[row[1]] = max(oldest_wait.get(row[1], 0.0), float(row[9]))
    ages = {e: h.oldest_due_age for e, h in snapshot.health.items()}
    assert ages.keys() == oldest_wait.keys()
    for effect, waited in oldest_wait.items():
        assert ages[effect] == pytest.approx(waited, abs=5.0)


def test_gauges_read_zero_for_an_effect_with_nothing_unfinished(dsn: str, schema: str) -> None:
    seed(dsn, schema, {"key": "d1", "status": "done"}, {"key": "f1", "status": "failed"},
         {"key": "c1", "effect": "charge.card"})
    collector = DatabaseCollector(dsn, schema)
    got = scrape(collector)
    for name in ("outbox_oldest_due_job_age_seconds", "outbox_expired_leases",
                 "outbox_oldest_reconcile_job_age_seconds"):
        assert got[(name, (("effect", "email.send"),))] == 0
    assert got[("outbox_database_up", ())] == 1
    # Every row of charge.card gone (done and purged): its gauges stay, at 0.
    with psycopg.connect(dsn) as conn:
        conn.execute(sql.SQL("DELETE FROM {}.jobs WHERE effect = 'charge.card'").format(
            sql.Identifier(schema)))
    got = scrape(collector)
    assert got[("outbox_jobs", (("effect", "charge.card"), ("status", "pending")))] == 0
    assert oldest_due(got, "charge.card") == 0


def test_a_database_that_cannot_be_read_is_reported_not_raised(dsn: str, schema: str) -> None:
    unreadable = psycopg.conninfo.make_conninfo(dsn, dbname="no_such_database")
    got = scrape(DatabaseCollector(unreadable, schema))
    assert got == {("outbox_database_up", ()): 0}


@pytest.mark.anyio
async def test_the_dashboard_overview_uses_the_same_due(
        client: httpx.AsyncClient, dsn: str, schema: str) -> None:
    seed_held_back(dsn, schema)
    response = await client.get("/")
    assert response.status_code == 200
    # The oldest due tile: 1m (o9-1), not the 15m of the jobs held back.
    assert '<span class="n">1m</span><span class="label">oldest due job' in response.text
    metrics = await client.get("/metrics")
    got = {}
    for family in text_string_to_metric_families(metrics.text):
        for s in family.samples:
            got[(s.name, tuple(sorted(s.labels.items())))] = s.value
    assert 60 <= oldest_due(got, "email.send") < 120
