"""The schedules' database gauges: last and next slot, paused, and the overdue count."""

from __future__ import annotations

from datetime import UTC, datetime

import psycopg
from prometheus_client.parser import text_string_to_metric_families
from psycopg import sql

import outbox
from outbox.metrics import render_database_metrics

from .support import EFFECT, Recording


def gauges(dsn: str, schema: str) -> dict[tuple[str, str], float]:
    text, _ = render_database_metrics(dsn, schema)
    return {(sample.name, sample.labels.get("schedule", "")): sample.value
            for family in text_string_to_metric_families(text.decode())
            for sample in family.samples if "schedule" in sample.name}


def test_the_gauges_say_when_each_schedule_last_fired_and_which_are_overdue(
        dsn: str, schema: str) -> None:
    clock = [datetime(2025, 6, 10, 2, 59, tzinfo=UTC)]
    d = outbox.Dispatcher(dsn, effects=[Recording()], schema=schema, schedules=[
        outbox.Schedule("nightly", effect=EFFECT, cron="0 3 * * *"),
        outbox.Schedule("weekly", effect=EFFECT, cron="0 3 * * 1")])
    d._schedule_clock = lambda: clock[0]
    d.run_until_idle(timeout=30)
    clock[0] = datetime(2025, 6, 10, 3, 0, 1, tzinfo=UTC)
    d.run_until_idle(timeout=30)
    found = gauges(dsn, schema)
    fired = datetime(2025, 6, 10, 3, tzinfo=UTC).timestamp()
    assert found[("outbox_schedule_last_slot_timestamp_seconds", "nightly")] == fired
    assert found[("outbox_schedule_next_slot_timestamp_seconds", "nightly")] == fired + 86400
    assert found[("outbox_schedule_last_slot_timestamp_seconds", "weekly")] == 0
    assert found[("outbox_schedule_paused", "nightly")] == 0
    # Against the database's clock (later than the fake June 2025), both slots are long
    # past and nothing enqueued them: overdue.
    assert found[("outbox_schedules_overdue", "")] == 2
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("UPDATE {}.schedules SET paused = true WHERE name = 'weekly'")
                     .format(sql.Identifier(schema)))
    found = gauges(dsn, schema)
    assert found[("outbox_schedule_paused", "weekly")] == 1
    assert found[("outbox_schedules_overdue", "")] == 1
