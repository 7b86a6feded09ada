"""The schedules' gauges (``outbox.Schedule``), read from the schedules table with the
other database gauges (``outbox._database_metrics``):

- ``outbox_schedule_last_slot_timestamp_seconds{schedule}``: the last slot enqueued (0:
  never);
- ``outbox_schedule_next_slot_timestamp_seconds{schedule}``: the next slot due; one past
  by minutes means no dispatcher enqueues it (the alert ``OutboxScheduleOverdue``);
- ``outbox_schedule_paused{schedule}``: 1 while paused;
- ``outbox_schedules_overdue``: unpaused schedules whose next slot passed over
  ``OVERDUE`` seconds ago, whatever their number (no label: safe with 10,000).

The per-schedule gauges cover at most ``MAX_SCHEDULES`` schedules, the unpaused most
overdue first, so a Prometheus label set stays bounded.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import psycopg
from prometheus_client.core import GaugeMetricFamily, Metric
from psycopg.rows import dict_row

from ._schedule_store import schedule_queries

__all__ = ["MAX_SCHEDULES", "OVERDUE", "read_schedules", "schedule_families"]

MAX_SCHEDULES = 200
OVERDUE = 120.0  # seconds past a slot: a round comes within a second or two of it


def read_schedules(conn: psycopg.Connection[Any], schema: str) -> list[dict[str, Any]]:
    """The schedules' rows the gauges need (in the caller's transaction)."""
    return conn.cursor(row_factory=dict_row).execute(
        schedule_queries(schema).schedule_gauges,
        {"limit": MAX_SCHEDULES, "grace": OVERDUE}).fetchall()


def schedule_families(rows: list[dict[str, Any]]) -> Iterable[Metric]:
    """The gauges of ``rows`` (``read_schedules``)."""
    last = GaugeMetricFamily(
        "outbox_schedule_last_slot_timestamp_seconds",
        "The last slot of the schedule that was enqueued (Unix time; 0: never).",
        labels=["schedule"])
    following = GaugeMetricFamily(
        "outbox_schedule_next_slot_timestamp_seconds",
        "The next slot due of the schedule (Unix time): long past, no dispatcher "
        "enqueues it.", labels=["schedule"])
    paused = GaugeMetricFamily("outbox_schedule_paused", "1 while the schedule is paused.",
                               labels=["schedule"])
    for row in rows:
        last.add_metric([row["name"]], row["last_slot"] or 0.0)
        following.add_metric([row["name"]], row["next_slot"])
        paused.add_metric([row["name"]], 1.0 if row["paused"] else 0.0)
    overdue = GaugeMetricFamily(
        "outbox_schedules_overdue", "Unpaused schedules whose next slot passed more than "
        "120 s ago (OVERDUE): nothing enqueued it.", value=rows[0]["overdue"] if rows else 0)
    return (last, following, paused, overdue)
