"""The scrape past its caps: a status with more than 10,000 jobs and a backlog past
2,000 pending jobs are estimated from a block sample, close to the truth; every status
below the cap stays exact. Read through the public collector, as Prometheus does."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from psycopg import sql

from outbox.cli import main
from outbox.metrics import DatabaseCollector

NOISY = 15_000  # one tenant's backlog
QUIET = 1_000  # groups of 10 pending jobs each
FAILED = 3


def _fill(dsn: str, schema: str) -> None:
    jobs = sql.Identifier(schema, "jobs")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("""
            INSERT INTO {} (effect, key, payload, fingerprint, status, group_key,
                            available_at, last_error, attempts)
            SELECT 'mail.send', 'k' || n, '{{}}', 'f',
                   CASE WHEN n <= %(failed)s THEN 'failed' ELSE 'pending' END,
                   CASE WHEN n <= %(noisy)s THEN 'noisy' ELSE 'quiet-' || n %% %(quiet)s END,
                   now() - interval '1 minute',
                   CASE WHEN n <= %(failed)s THEN 'boom' END, 1
            FROM generate_series(1, %(total)s) AS n""").format(jobs),
            {"failed": FAILED, "noisy": NOISY, "quiet": QUIET,
             "total": NOISY + 10 * QUIET})
        conn.execute(sql.SQL("VACUUM ANALYZE {}").format(jobs))


def _gauges(dsn: str, schema: str) -> dict[tuple[str, tuple[Any, ...]], float]:
    found = {}
    for family in DatabaseCollector(dsn, schema).collect():
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def test_past_the_caps_the_gauges_are_estimates_near_the_truth(dsn: str, schema: str) -> None:
    _fill(dsn, schema)
    gauges = _gauges(dsn, schema)
    assert gauges[("outbox_database_up", ())] == 1
    pending = gauges[("outbox_jobs", (("effect", "mail.send"), ("status", "pending")))]
    truth = NOISY + 10 * QUIET - FAILED
    assert abs(pending - truth) <= 0.2 * truth, pending  # past 10,000: estimated
    # below the cap: exact, even though another status is estimated
    assert gauges[("outbox_jobs", (("effect", "mail.send"), ("status", "failed")))] == FAILED
    assert gauges[("outbox_jobs", (("effect", "mail.send"), ("status", "done")))] == 0
    # the noisy tenant stands out at about its size; no quiet group is taken for it
    busiest = gauges[("outbox_busiest_group_pending", (("effect", "mail.send"),))]
    assert abs(busiest - (NOISY - FAILED)) <= 0.3 * NOISY, busiest


def test_below_the_caps_every_gauge_is_exact(dsn: str, schema: str) -> None:
    jobs = sql.Identifier(schema, "jobs")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("""
            INSERT INTO {} (effect, key, payload, fingerprint, group_key)
            SELECT 'mail.send', 'k' || n, '{{}}', 'f', 'g' || n %% %(groups)s
            FROM generate_series(1, 1500) AS n""").format(jobs), {"groups": 7})
        conn.execute(sql.SQL("VACUUM ANALYZE {}").format(jobs))
    gauges = _gauges(dsn, schema)
    assert gauges[("outbox_jobs", (("effect", "mail.send"), ("status", "pending")))] == 1500
    # 1500 over 7 groups: g1..g2 hold 215 (n % 7 = 1, 2, ...), the others 214
    assert gauges[("outbox_busiest_group_pending", (("effect", "mail.send"),))] == 215


def test_a_due_count_that_stopped_at_its_cap_says_so(
        dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("""
            INSERT INTO {} (effect, key, payload, fingerprint)
            SELECT 'mail.send', 'k' || n, '{{}}', 'f' FROM generate_series(1, 5) AS n""")
            .format(sql.Identifier(schema, "jobs")))
    monkeypatch.setattr("outbox._queue.COUNT_CAP", 3)  # 5 due jobs: past the cap
    text = CliRunner().invoke(main, ["status", "--dsn", dsn, "--schema", schema])
    assert text.exit_code == 0, text.output
    assert "due backlog: 3+," in text.output
    report = json.loads(CliRunner().invoke(
        main, ["status", "--dsn", dsn, "--schema", schema, "--json"]).output)
    assert (report["due_backlog"], report["due_backlog_capped"]) == (3, True)
    monkeypatch.setattr("outbox._queue.COUNT_CAP", 10)  # below the cap: exact, no +
    text = CliRunner().invoke(main, ["status", "--dsn", dsn, "--schema", schema])
    assert "due backlog: 5," in text.output
