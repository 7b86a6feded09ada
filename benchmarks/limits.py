"""Section "limits": dispatchers against a provider that pushes back.

Three figures, each against a local Resend-shaped provider (``FakeEmailProvider``, run in
the parent process; the dispatchers are real processes sending real HTTP):

- burst, no limit declared: ``jobs`` email jobs at once, one dispatcher, a provider
  admitting ``rate`` requests/s (429 with ``retry-after`` and ``ratelimit-*`` past it).
  The ratio is the ideal drain time (jobs / rate) over the measured one; also failed
  jobs, the most attempts any job counted, and the share of requests answered 429.
- burst, ``Limit(rate=rate)`` declared, ``procs`` dispatcher processes sharing it.
- per group: ``groups`` tenants of ``group_jobs`` emails each, sending from their own
  domains, against a provider admitting ``group_rate`` requests/s per sending domain
  (``rate_limit_per_domain``), ``Limit(rate=group_rate, per_group=True)`` declared on
  ``procs`` processes. The ideal is every tenant at its domain's rate at once
  (``group_jobs / group_rate``); the ratio, failed jobs and the share of 429s as above.
- outage: ``outage`` seconds of 503 to every request with ``jobs`` jobs waiting, then
  recovery: failed jobs, seconds from recovery to the last job done, and requests made
  during the outage per job.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import psycopg
import psycopg.sql

import outbox
from effects.email import SendEmail
from effects.testing import FakeEmailProvider

from ._db import Server, fresh_database, migrated, table
from ._procs import Prepared, run_released
from ._results import Row, Section, Target
from ._stats import Figure

EMAIL = {"from": "shop@example.com", "to": "customer@example.com",
         "subject": "Your order", "text": "Thank you for your order."}


@dataclass(frozen=True)
class LimitsConfig:
    runs: int
    jobs: int = 200
    rate: float = 10.0
    procs: int = 3
    outage: float = 30.0
    groups: int = 3
    group_jobs: int = 50
    group_rate: float = 5.0


@dataclass(frozen=True)
class EmailWorkerSpec:
    dsn: str
    url: str
    rate: float | None  # the declared Limit's rate, or None
    timeout: float
    per_group: bool = False


def email_worker(spec: EmailWorkerSpec) -> Prepared:
    """A dispatcher process with ``SendEmail`` against the fake, default settings."""
    limits = None if spec.rate is None else {
        "email.send": outbox.Limit(rate=spec.rate, per_group=spec.per_group)}
    dispatcher = outbox.Dispatcher(spec.dsn, [SendEmail("re_bench", base_url=spec.url)],
                                   limits=limits)

    def run() -> dict[str, Any]:
        return dispatcher.run_until_idle(timeout=spec.timeout).as_dict()

    return Prepared(run)


def _enqueue(dsn: str, jobs: int) -> None:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn) as tx:
        tx.enqueue_many([outbox.NewJob("email.send", f"email-{i}", EMAIL) for i in range(jobs)])


def _enqueue_groups(dsn: str, groups: int, jobs: int) -> None:
    """``jobs`` emails for each of ``groups`` tenants, each from the tenant's own domain."""
    with psycopg.connect(dsn) as conn, outbox.transaction(conn) as tx:
        tx.enqueue_many([outbox.NewJob("email.send", f"email-t{g}-{i}",
                                       {**EMAIL, "from": f"Shop <shop@t{g}.example>"},
                                       group=f"t{g}")
                         for i in range(jobs) for g in range(groups)])


def _outcome(dsn: str) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        counts: dict[str, int] = dict(conn.execute(psycopg.sql.SQL(
            "SELECT status, count(*) FROM {} GROUP BY status").format(
                table("outbox", "jobs"))).fetchall())
        attempts, last_done = conn.execute(psycopg.sql.SQL(
            "SELECT (SELECT max(attempts) FROM {}), (SELECT extract(epoch FROM "
            "max(recorded_at)) FROM {})").format(
                table("outbox", "jobs"), table("outbox", "effect_results"))).fetchone() or (0, 0)
    return {"counts": counts, "max_attempts": attempts or 0, "last_done": float(last_done or 0)}


def measure_burst(server: Server, config: LimitsConfig, *, declared: bool) -> dict[str, Any]:
    procs = config.procs if declared else 1
    with fresh_database(server, "limits") as dsn, FakeEmailProvider(
            rate_limit=config.rate) as fake:
        migrated(dsn)
        _enqueue(dsn, config.jobs)
        timeout = 60.0 + 5 * config.jobs / config.rate
        spec = EmailWorkerSpec(dsn, fake.url, config.rate if declared else None, timeout)
        released = run_released(email_worker, [spec] * procs, timeout=timeout + 30)
        outcome = _outcome(dsn)
        requests, throttled = fake.total_requests, fake.throttled
    done = outcome["counts"].get("done", 0)
    if done != config.jobs:
        raise AssertionError(f"limits burst finished {done} of {config.jobs} jobs: {outcome}")
    ideal = config.jobs / config.rate
    return {"declared": declared, "procs": procs, "seconds": released.seconds, "ideal": ideal,
            "ratio": ideal / released.seconds, "failed": outcome["counts"].get("failed", 0),
            "max_attempts": outcome["max_attempts"], "requests": requests,
            "throttled": throttled, "share_429": throttled / requests if requests else 0.0,
            "stats": released.results}


def measure_groups(server: Server, config: LimitsConfig) -> dict[str, Any]:
    jobs = config.groups * config.group_jobs
    with fresh_database(server, "limits") as dsn, FakeEmailProvider(
            rate_limit_per_domain=config.group_rate) as fake:
        migrated(dsn)
        _enqueue_groups(dsn, config.groups, config.group_jobs)
        timeout = 60.0 + 5 * config.group_jobs / config.group_rate
        spec = EmailWorkerSpec(dsn, fake.url, config.group_rate, timeout, per_group=True)
        released = run_released(email_worker, [spec] * config.procs, timeout=timeout + 30)
        outcome = _outcome(dsn)
        requests, throttled = fake.total_requests, fake.throttled
    done = outcome["counts"].get("done", 0)
    if done != jobs:
        raise AssertionError(f"limits per group finished {done} of {jobs} jobs: {outcome}")
    ideal = config.group_jobs / config.group_rate
    return {"seconds": released.seconds, "ideal": ideal, "ratio": ideal / released.seconds,
            "failed": outcome["counts"].get("failed", 0), "max_attempts": outcome["max_attempts"],
            "requests": requests, "throttled": throttled,
            "share_429": throttled / requests if requests else 0.0, "stats": released.results}


def measure_outage(server: Server, config: LimitsConfig) -> dict[str, Any]:
    with fresh_database(server, "limits") as dsn, FakeEmailProvider() as fake:
        migrated(dsn)
        _enqueue(dsn, config.jobs)
        fake.set_outage(True)
        recovered: dict[str, float] = {}

        def recover() -> None:
            time.sleep(config.outage)
            recovered["requests"] = fake.total_requests
            recovered["at"] = time.time()
            fake.set_outage(False)

        timer = threading.Thread(target=recover, daemon=True)
        timeout = config.outage + 120.0
        spec = EmailWorkerSpec(dsn, fake.url, None, timeout)
        released = run_released(email_worker, [spec], timeout=timeout + 30,
                                before_release=lambda pids: timer.start())
        timer.join()
        outcome = _outcome(dsn)
    done = outcome["counts"].get("done", 0)
    return {"done": done, "failed": outcome["counts"].get("failed", 0),
            "max_attempts": outcome["max_attempts"],
            "after_recovery": outcome["last_done"] - recovered["at"],
            "requests_during": recovered["requests"],
            "per_job": recovered["requests"] / config.jobs, "seconds": released.seconds,
            "stats": released.results}


def _burst_rows(config: LimitsConfig, runs: list[dict[str, Any]], declared: bool) -> list[Row]:
    mine = [r for r in runs if r["declared"] == declared]
    label = (f"{config.jobs} emails, provider {config.rate:g}/s, Limit(rate={config.rate:g}) "
             f"on {config.procs} processes" if declared else
             f"{config.jobs} emails, provider {config.rate:g}/s, no limit declared")
    ratio = Figure.of([r["ratio"] for r in mine])
    rows = [
        Row("limits", f"{label}: drain time", "s", Figure.of([r["seconds"] for r in mine]),
            "ideal jobs/rate", Figure.of([r["ideal"] for r in mine]), ratio,
            Target(">=", 0.85 if declared else 0.8),
            note="ratio is ideal over measured"),
        Row("limits", f"{label}: failed jobs", "jobs", Figure.of([r["failed"] for r in mine]),
            target=Target("<=", 0, on="value")),
        Row("limits", f"{label}: most attempts counted by a job", "attempts",
            Figure.of([r["max_attempts"] for r in mine]), target=Target("<=", 3, on="value")),
    ]
    share = Figure.of([r["share_429"] for r in mine])
    rows.append(Row("limits", f"{label}: share of requests answered 429", "share", share,
                    target=Target("<=", 0.05, on="value") if declared else None))
    return rows


def _group_rows(config: LimitsConfig, runs: list[dict[str, Any]]) -> list[Row]:
    label = (f"{config.groups} tenants x {config.group_jobs} emails, provider "
             f"{config.group_rate:g}/s per sending domain, Limit(rate={config.group_rate:g}, "
             f"per_group=True) on {config.procs} processes")
    return [
        Row("limits", f"{label}: drain time", "s", Figure.of([r["seconds"] for r in runs]),
            "ideal jobs per tenant/rate", Figure.of([r["ideal"] for r in runs]),
            Figure.of([r["ratio"] for r in runs]), Target(">=", 0.85),
            note="ratio is ideal over measured"),
        Row("limits", f"{label}: failed jobs", "jobs", Figure.of([r["failed"] for r in runs]),
            target=Target("<=", 0, on="value")),
        Row("limits", f"{label}: share of requests answered 429", "share",
            Figure.of([r["share_429"] for r in runs]), target=Target("<=", 0.05, on="value")),
    ]


def _outage_rows(config: LimitsConfig, runs: list[dict[str, Any]]) -> list[Row]:
    label = f"{config.outage:g} s outage (503), {config.jobs} jobs waiting"
    return [
        Row("limits", f"{label}: failed jobs", "jobs", Figure.of([r["failed"] for r in runs]),
            target=Target("<=", 0, on="value")),
        Row("limits", f"{label}: recovery to last job done", "s",
            Figure.of([r["after_recovery"] for r in runs]), target=Target("<=", 20, on="value")),
        Row("limits", f"{label}: requests during the outage per job", "requests/job",
            Figure.of([r["per_job"] for r in runs]), target=Target("<=", 0.5, on="value")),
    ]


def run(server: Server, config: LimitsConfig) -> Section:
    """Each figure ``config.runs`` times, interleaved."""
    bursts: list[dict[str, Any]] = []
    outages: list[dict[str, Any]] = []
    grouped: list[dict[str, Any]] = []
    for _ in range(config.runs):
        bursts.append(measure_burst(server, config, declared=False))
        bursts.append(measure_burst(server, config, declared=True))
        grouped.append(measure_groups(server, config))
        outages.append(measure_outage(server, config))
    rows = [*_burst_rows(config, bursts, False), *_burst_rows(config, bursts, True),
            *_group_rows(config, grouped), *_outage_rows(config, outages)]
    settings = {"dispatcher": "Dispatcher defaults (concurrency 16)",
                "provider": f"FakeEmailProvider(rate_limit={config.rate:g}): a token bucket "
                            "holding one second of requests",
                "effect": "effects.email.SendEmail over HTTP"}
    return Section("limits", rows, raw={"config": vars(config), "bursts": bursts,
                                        "per_group": grouped, "outages": outages},
                   settings=settings)
