"""The database gauges (``outbox-pg[prometheus]``): the queue as ``outbox._queue`` reads it,
as Prometheus metric families. Needs prometheus-client only: the dashboard serves these
at ``/metrics`` and ``outbox.metrics`` exports them, and neither imports the other.

Every gauge is emitted for every effect known to the collector (seen in this reading or
an earlier one of the same collector), at 0 when the effect has nothing of that kind:
a gauge that vanishes cannot be told from a scrape that failed. ``outbox_database_up``
is 1 when the reading succeeded and 0 (with no other gauge) when the database could not
be read, so an alert can fire on the scrape itself.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import psycopg
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector
from psycopg.rows import class_row, dict_row

from . import _queue
from ._dispatch.presence import Unserved
from ._schedule_metrics import read_schedules, schedule_families
from ._sql import check_schema_name, queries

__all__ = ["MAX_EFFECTS", "SCRAPE_TIMEOUT", "DatabaseCollector", "render_database_metrics"]

log = logging.getLogger("outbox.metrics")

MAX_EFFECTS = 50
SCRAPE_TIMEOUT = "5s"


class DatabaseCollector(Collector):
    """Gauges computed from the outbox tables on each scrape (one connection, one
    read-only transaction bounded by a statement timeout), none of whose statements
    reads the whole backlog or the history: ``outbox_jobs{status,effect}`` (exact for a
    status with at most ``COUNT_CAP`` jobs, estimated from a block sample beyond),
    ``outbox_oldest_due_job_age_seconds{effect}`` (due as the claim decides it: ordering
    keys respected),
    ``outbox_expired_leases{effect}``, ``outbox_oldest_reconcile_job_age_seconds
    {effect}``, ``outbox_waiting_jobs{effect}`` (pending jobs waiting on their parents,
    ``after=[...]``: not due), ``outbox_jobs_dead_tuples``,
    ``outbox_unhandled_due_jobs{effect}`` (due jobs of an effect no running dispatcher
    handles; counted up to ``COUNT_CAP``), ``outbox_busiest_group_pending{effect}``
    (the pending jobs of the effect's largest group: a noisy tenant's backlog, with no
    group label, whose values are unbounded; exact up to ``GROUP_CAP`` pending jobs,
    estimated beyond), the schedules' gauges (``outbox._schedule_metrics``) and
    ``outbox_database_up``.

    A database error never fails the scrape: it is logged (by type only) and reported as
    ``outbox_database_up 0``. Effects past ``MAX_EFFECTS`` fold into ``other``."""

    def __init__(self, conninfo: str, schema: str = "outbox") -> None:
        self.conninfo = conninfo
        self.schema = check_schema_name(schema)
        self._seen: set[str] = set()  # effects read so far: their gauges stay, at 0
        self._lock = threading.Lock()

    def collect(self) -> Iterator[Metric]:
        """Read the tables and yield the gauges (only ``outbox_database_up 0`` when the
        database cannot be read)."""
        up = GaugeMetricFamily("outbox_database_up",
                               "1 when the last scrape read the outbox tables, else 0.")
        try:
            snapshot, unhandled, limits, groups, schedules = self._read()
        except psycopg.Error as exc:
            log.error("database metrics: cannot read the outbox tables (%s)",
                      getattr(exc, "sqlstate", None) or type(exc).__name__)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        with self._lock:
            self._seen |= snapshot.effects()
            effects = set(self._seen)
        yield from _families(snapshot, effects)
        yield _unhandled_family(unhandled, effects)
        yield _busiest_group_family(groups, effects)
        yield from _limit_families(limits)
        yield from schedule_families(schedules)

    def _read(self) -> tuple[_queue.Snapshot, list[Unserved], list[dict[str, Any]],
                             dict[str, list[_queue.GroupBacklog]], list[dict[str, Any]]]:
        with psycopg.connect(self.conninfo, connect_timeout=10) as conn:
            conn.read_only = True
            with conn.transaction():
                conn.execute("SELECT set_config('statement_timeout', %s, true)",
                             (SCRAPE_TIMEOUT,))
                snapshot = _queue.read(conn, self.schema)
                unhandled = [u for u in conn.cursor(row_factory=class_row(Unserved)).execute(
                    _queue.queue_queries(self.schema).unserved_due,
                    {"cap": _queue.COUNT_CAP}).fetchall() if u.due]
                limits = conn.cursor(row_factory=dict_row).execute(
                    queries(self.schema).limits_overview).fetchall()
                groups = _queue.on(conn, _queue.busiest_groups(self.schema, 1,
                                                               snapshot.sampled_groups))
                schedules = read_schedules(conn, self.schema)
                return snapshot, unhandled, limits, groups, schedules


def _unhandled_family(rows: list[Unserved], known: set[str]) -> Metric:
    """``outbox_unhandled_due_jobs{effect}``: due jobs of effects that no running
    dispatcher handles (``<schema>.dispatchers``), which wait until one does. Only the
    effects nobody serves have their due jobs read (``unserved_due``), each counted up to
    ``COUNT_CAP``, so a scrape stays cheap behind any backlog of served effects."""
    bounded = _bounded_effects(known | {unserved.effect for unserved in rows})
    family = GaugeMetricFamily(
        "outbox_unhandled_due_jobs",
        "Due pending jobs of an effect no running dispatcher handles (a typo in the "
        "effect name, or its dispatcher not running); counted up to 10,000.",
        labels=["effect"])
    folded = {bounded(effect): 0 for effect in known}
    for unserved in rows:
        effect = bounded(unserved.effect)
        folded[effect] = folded.get(effect, 0) + int(unserved.due)
    for effect, due in sorted(folded.items()):
        family.add_metric([effect], due)
    return family


def _busiest_group_family(groups: dict[str, list[_queue.GroupBacklog]],
                          known: set[str]) -> Metric:
    """``outbox_busiest_group_pending{effect}``: the pending jobs of each effect's largest
    group (jobs without a group count as one group), 0 with none pending. The group's
    name is no label: tenants are unbounded, a Prometheus label set must not be."""
    bounded = _bounded_effects(known | set(groups))
    family = GaugeMetricFamily(
        "outbox_busiest_group_pending", "Pending jobs of the effect's largest group "
        "(tenant): one tenant's backlog (outbox status names the group); exact up to "
        "2,000 pending jobs of the schema, estimated from a block sample beyond.",
        labels=["effect"])
    folded = {bounded(effect): 0 for effect in known}
    for effect, found in groups.items():
        label = bounded(effect)
        folded[label] = max(folded.get(label, 0), found[0].pending if found else 0)
    for effect, pending in sorted(folded.items()):
        family.add_metric([effect], pending)
    return family


def _families(snapshot: _queue.Snapshot, known: set[str]) -> Iterable[Metric]:
    bounded = _bounded_effects(known)
    effects = sorted({bounded(e) for e in known})
    jobs = GaugeMetricFamily("outbox_jobs", "Jobs per status and effect: exact for a "
                             "status with at most 10,000 jobs, estimated from a block "
                             "sample beyond.", labels=["status", "effect"])
    folded: dict[tuple[str, str], int] = {}
    for (status, effect), n in snapshot.counts.counts.items():
        label = (status, bounded(effect))
        folded[label] = folded.get(label, 0) + n
    for effect in effects:
        for status in _queue.STATUSES:
            jobs.add_metric([status, effect], folded.get((status, effect), 0))
    oldest = GaugeMetricFamily(
        "outbox_oldest_due_job_age_seconds",
        "Seconds the oldest due pending job has waited (0 when none is due); a job held "
        "back by its ordering key is not due.", labels=["effect"])
    expired = GaugeMetricFamily(
        "outbox_expired_leases", "Running jobs whose lease has passed.", labels=["effect"])
    reconcile = GaugeMetricFamily(
        "outbox_oldest_reconcile_job_age_seconds",
        "Seconds the oldest reconcile job has waited for a person (0 when none).",
        labels=["effect"])
    waiting = GaugeMetricFamily(
        "outbox_waiting_jobs", "Pending jobs waiting on their parents (after=[...]): "
        "not due, so not counted as due work nor in the oldest due age.",
        labels=["effect"])
    merged = {effect: _Merged() for effect in effects}
    for health in snapshot.health.values():
        merged[bounded(health.effect)].add(health)
    for effect, folded_health in sorted(merged.items()):
        oldest.add_metric([effect], folded_health.oldest_due_age)
        expired.add_metric([effect], folded_health.expired_leases)
        reconcile.add_metric([effect], folded_health.oldest_reconcile_age)
        waiting.add_metric([effect], folded_health.waiting)
    dead_tuples = GaugeMetricFamily(
        "outbox_jobs_dead_tuples", "Dead tuples in the jobs table (vacuum debt).",
        value=snapshot.counts.dead_tuples)
    return (jobs, oldest, expired, reconcile, waiting, dead_tuples)


@dataclass(slots=True)
class _Merged:
    """The health of the effects folded into one label (``other`` past MAX_EFFECTS)."""

    oldest_due_age: float = 0.0
    expired_leases: int = 0
    oldest_reconcile_age: float = 0.0
    waiting: int = 0

    def add(self, health: _queue.EffectHealth) -> None:
        self.oldest_due_age = max(self.oldest_due_age, health.oldest_due_age or 0.0)
        self.expired_leases += health.expired_leases
        self.oldest_reconcile_age = max(self.oldest_reconcile_age,
                                        health.oldest_reconcile_age or 0.0)
        self.waiting += health.waiting


PAUSE_REASONS = ("throttled", "outage", "operator")


def _limit_families(limits: Sequence[dict[str, Any]]) -> Iterable[Metric]:
    """From the shared limit state (``limits_overview``): which effects are paused and
    why, and how often each was throttled, across every dispatcher."""
    bounded = _bounded_effects({row["effect"] for row in limits})
    paused = GaugeMetricFamily(
        "outbox_effect_paused", "1 while the effect is paused for every dispatcher, by "
        "reason (throttled, outage: its breaker is open, operator).",
        labels=["effect", "reason"])
    throttled = CounterMetricFamily(
        "outbox_effect_throttled", "Performs the provider refused for load (Throttled), "
        "across every dispatcher.", labels=["effect"])
    reasons: dict[str, str | None] = {}
    totals: dict[str, float] = {}
    for row in limits:
        effect = bounded(row["effect"])
        if row["paused"]:
            reasons[effect] = row["pause_reason"]
        else:
            reasons.setdefault(effect, None)
        totals[effect] = totals.get(effect, 0) + row["throttled_total"]
    for effect in sorted(reasons):
        for reason in PAUSE_REASONS:
            paused.add_metric([effect, reason], 1.0 if reasons[effect] == reason else 0.0)
        throttled.add_metric([effect], totals[effect])
    return (paused, throttled)


def _bounded_effects(effects: set[str]) -> Callable[[str], str]:
    kept = set(sorted(effects)[:MAX_EFFECTS])
    return lambda effect: effect if effect in kept else "other"


@cache
def _collector(conninfo: str, schema: str) -> DatabaseCollector:
    # One per database and schema for the process, so the effects it has seen keep
    # their gauges (at 0) from one scrape to the next.
    return DatabaseCollector(conninfo, schema)


def render_database_metrics(conninfo: str, schema: str = "outbox") -> tuple[bytes, str]:
    """The database gauges in the Prometheus text format, and its content type."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_collector(conninfo, schema))
    return generate_latest(registry), CONTENT_TYPE_LATEST
