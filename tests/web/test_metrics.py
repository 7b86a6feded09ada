"""Metrics: the database gauges match seeded tables; the observer counts what it is told;
the example alert rules parse and name only metrics outbox exports."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import psycopg
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import outbox
from outbox.metrics import DatabaseCollector, PrometheusObserver
from outbox.observe import DispatchObserver, MultiObserver

from .support import seed

ALERTS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "alerts.yml"


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, keyed by name and sorted labels."""
    found = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            found[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return found


def seed_mixed(dsn: str, schema: str) -> None:
    now = datetime.now(UTC)
    seed(dsn, schema,
         {"key": "p1", "available_at": now - timedelta(seconds=600)},
         {"key": "p2", "available_at": now - timedelta(seconds=60)},
         {"key": "p3", "available_at": now + timedelta(hours=1)},  # not due yet
         {"key": "c1", "effect": "charge.card", "status": "running",
          "lease_until": now - timedelta(seconds=5)},  # expired
         {"key": "c2", "effect": "charge.card", "status": "running"},
         {"key": "c3", "effect": "charge.card", "status": "reconcile",
          "updated_at": now - timedelta(seconds=7200)},
         {"key": "d1", "status": "done"}, {"key": "d2", "status": "done"},
         {"key": "f1", "status": "failed"})


def test_database_gauges_match_the_tables(dsn: str, schema: str) -> None:
    seed_mixed(dsn, schema)
    registry = CollectorRegistry()
    registry.register(DatabaseCollector(dsn, schema))
    got = samples(generate_latest(registry).decode())

    def jobs(status: str, effect: str) -> float:
        return got[("outbox_jobs", (("effect", effect), ("status", status)))]

    assert [jobs(s, "email.send") for s in ("pending", "running", "done", "failed",
                                            "reconcile")] == [3, 0, 2, 1, 0]
    assert [jobs(s, "charge.card") for s in ("pending", "running", "done", "failed",
                                             "reconcile")] == [0, 2, 0, 0, 1]
    oldest = got[("outbox_oldest_due_job_age_seconds", (("effect", "email.send"),))]
    assert 600 <= oldest < 900
    assert got[("outbox_oldest_due_job_age_seconds", (("effect", "charge.card"),))] == 0
    assert got[("outbox_expired_leases", (("effect", "charge.card"),))] == 1
    reconcile = got[("outbox_oldest_reconcile_job_age_seconds", (("effect", "charge.card"),))]
    assert 7200 <= reconcile < 7500
    assert ("outbox_jobs_dead_tuples", ()) in got


@pytest.mark.anyio
async def test_the_dashboard_serves_the_gauges_at_metrics(
        client: httpx.AsyncClient, dsn: str, schema: str) -> None:
    seed_mixed(dsn, schema)
    response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    got = samples(response.text)
    assert got[("outbox_jobs", (("effect", "email.send"), ("status", "failed")))] == 1


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_the_observer_counts_attempts_waits_claims_fences_and_rescues() -> None:
    registry = CollectorRegistry()
    observer = PrometheusObserver(registry)
    observer.claimed(0.004, [("email.send", 2.5), ("email.send", 0.2), ("charge.card", 40)])
    observer.claimed(0.001, [])
    for _ in range(3):
        observer.attempt_started("email.send")
    observer.attempt_finished("email.send", "done", 0.05)
    observer.attempt_finished("email.send", "done", 0.07)
    observer.attempt_finished("email.send", "retry", 1.5)
    observer.attempt_finished("charge.card", "released", 0.0)
    observer.fence_rejected("email.send")
    observer.rescued(4)
    got = samples(generate_latest(registry).decode())
    assert got[("outbox_job_attempts_total", (("effect", "email.send"), ("outcome", "done")))] == 2
    assert got[("outbox_job_attempts_total", (("effect", "email.send"), ("outcome", "retry")))] == 1
    assert got[("outbox_job_attempt_duration_seconds_sum",
                (("effect", "email.send"), ("outcome", "done")))] == pytest.approx(0.12)
    assert got[("outbox_job_queue_wait_seconds_count", (("effect", "email.send"),))] == 2
    assert got[("outbox_job_queue_wait_seconds_sum", (("effect", "charge.card"),))] == 40
    assert got[("outbox_claim_duration_seconds_count", ())] == 2
    assert got[("outbox_fence_rejections_total", (("effect", "email.send"),))] == 1
    assert got[("outbox_lease_rescues_total", ())] == 4
    assert got[("outbox_jobs_in_flight", (("effect", "email.send"),))] == 0
    assert got[("outbox_last_claim_timestamp_seconds", ())] > 0


def test_the_default_observer_is_created_once() -> None:
    assert PrometheusObserver.default() is PrometheusObserver.default()


def exported_names() -> set[str]:
    registry = CollectorRegistry()
    observer = PrometheusObserver(registry)
    observer.claimed(0.001, [("e", 1.0)])
    observer.attempt_finished("e", "done", 0.1)
    names = {m.name for m in registry.collect()}
    names |= {"outbox_jobs", "outbox_oldest_due_job_age_seconds", "outbox_expired_leases",
              "outbox_oldest_reconcile_job_age_seconds", "outbox_jobs_dead_tuples",
              "outbox_database_up", "outbox_unhandled_due_jobs",
              "outbox_busiest_group_pending", "outbox_waiting_jobs",
              # outbox._schedule_metrics
              "outbox_schedule_last_slot_timestamp_seconds",
              "outbox_schedule_next_slot_timestamp_seconds", "outbox_schedule_paused",
              "outbox_schedules_overdue"}
    suffixes = ("_total", "_bucket", "_sum", "_count", "_created")
    return names | {n + s for n in names for s in suffixes}


def test_the_alert_rules_parse_and_name_only_exported_metrics() -> None:
    rules = yaml.safe_load(ALERTS.read_text())
    [group] = rules["groups"]
    alerts = {rule["alert"]: rule["expr"] for rule in group["rules"]}
    assert {"OutboxOldestDueJobTooOld", "OutboxFailureRatioHigh", "OutboxReconcileWaiting",
            "OutboxExpiredLeases", "OutboxNoClaimsWhileWorkIsDue"} <= alerts.keys()
    exported = exported_names()
    for name, expr in alerts.items():
        used = set(re.findall(r"\boutbox_[a-z_]+", expr))
        assert used, name
        assert used <= exported, f"{name} names unknown metrics {used - exported}"


class _Outcomes(outbox.Effect):
    """Ends each job as its payload says."""

    name = "test.outcome"

    def perform(self, job: outbox.Job) -> dict[str, str] | None:
        wanted = job.payload["outcome"]
        if wanted == "retry":
            raise outbox.Retry(after=3600)
        if wanted == "failed":
            raise outbox.Permanent("no")
        return {"ok": "yes"}


def test_a_dispatcher_reports_the_outcomes_it_ran(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        for i, outcome in enumerate(["done", "done", "done", "failed", "retry"]):
            tx.enqueue("test.outcome", key=f"m{i}", payload={"outcome": outcome})
    registry = CollectorRegistry()
    dispatcher = outbox.Dispatcher(dsn, [_Outcomes()], schema=schema,
                                   observer=PrometheusObserver(registry))
    stats = dispatcher.run_until_idle(timeout=60)
    assert (stats.done, stats.failed, stats.retried) == (3, 1, 1)
    got = samples(generate_latest(registry).decode())

    def attempts(outcome: str) -> float:
        return got.get(("outbox_job_attempts_total",
                        (("effect", "test.outcome"), ("outcome", outcome))), 0)

    assert [attempts(o) for o in ("done", "failed", "retry", "lost")] == [3, 1, 1, 0]
    assert got[("outbox_job_queue_wait_seconds_count", (("effect", "test.outcome"),))] == 5
    assert got[("outbox_job_attempt_duration_seconds_count",
                (("effect", "test.outcome"), ("outcome", "done")))] == 3
    assert got[("outbox_jobs_in_flight", (("effect", "test.outcome"),))] == 0
    assert got[("outbox_claim_duration_seconds_count", ())] >= 1


def test_metrics_true_adds_the_default_observer_once(dsn: str, schema: str) -> None:
    class Mine(DispatchObserver):
        pass

    mine = Mine()
    dispatcher = outbox.Dispatcher(dsn, [_Outcomes()], schema=schema, observer=mine,
                                   metrics=True)
    observer = dispatcher.settings.observer
    assert isinstance(observer, MultiObserver)
    assert observer.observers == (mine, PrometheusObserver.default())
    plain = outbox.Dispatcher(dsn, [_Outcomes()], schema=schema, metrics=True)
    assert plain.settings.observer is PrometheusObserver.default()
    in_loop = outbox.AsyncDispatcher(dsn, [_Outcomes()], schema=schema, metrics=True)
    assert in_loop.settings.observer is PrometheusObserver.default()


def test_enabling_metrics_later_reaches_the_dispatchers_state(dsn: str, schema: str) -> None:
    dispatcher = outbox.Dispatcher(dsn, [_Outcomes()], schema=schema)
    dispatcher.add_observer(PrometheusObserver.default())  # outbox run --metrics-port
    assert dispatcher.settings.observer is PrometheusObserver.default()
    assert dispatcher._state.observer is PrometheusObserver.default()
    assert dispatcher._state.observing
