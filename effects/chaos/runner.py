"""``run_chaos``: one chaos run from start to report, cleaning up whatever happens.

The run, in order: plan the jobs and the fault schedule from the seed; start the fake
providers and the database (embedded, or a database of its own on ``--dsn``); commit
the bulk share of the jobs; start the dispatcher processes; then, for ``duration``
seconds, trickle the rest of the jobs in from several threads while the fault schedule
runs and a monitor samples lease overruns (and the running jobs of each group under a
concurrency limit). Once the schedule is over and every job has ended (or the deadline
passed), stop the dispatchers with SIGTERM, collect their counters, and check the
invariants (``effects.chaos.checks``, and the limits' in ``effects.chaos.groups``).

With several targets (``ChaosConfig.targets``) the database holds one outbox schema per
target, each batch is enqueued into its target's schema, and each worker runs one fleet
dispatcher over all of them; the monitor, the fault aiming and the checks read every
target at once through the views of ``effects.chaos.database``.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psycopg

from ._sql import ChaosQueries, chaos_queries
from .broker import STREAM
from .checks import VIOLATIONS, Findings, check
from .config import KNOWN_FAULTS, ChaosConfig
from .database import Database, connect, provision, release
from .faults import FaultInjector
from .groups import group_figures
from .load import Enqueuer
from .monitor import LeaseMonitor
from .pool import WorkerPool, WorkerProcess
from .providers import WEBHOOK_SECRET, Providers, start_providers
from .report import ChaosReport
from .schedule import KAFKA_TOPIC, Batch, FaultEvent, JobPlan, build_schedule, plan_jobs
from .settings import WorkerSettings, application_name
from .standby import PairServer
from .windows import WINDOWS

__all__ = ["missing_faults", "run_chaos"]

Progress = Callable[[str], None]

# A worker's dispatcher returns within its stop_timeout of SIGTERM plus the time to
# close its connections; past this, the runner dumps its stacks and kills it.
_STOP_TIMEOUT = WorkerSettings.stop_timeout + 20.0
_JOIN_TIMEOUT = 90.0
_CONSUMER_DRAIN = 60.0
_PROGRESS_EVERY = 5.0
_WATCH_PAUSE = 0.2  # seconds between two looks at the jobs' states, at least
_WATCH_SHARE = 10  # and at least this many times what the last look took


class StatusWatch:
    """The jobs' states, counted on one kept connection (reopened after a restart).

    The count reads the whole jobs table: at a million rows, about a second of a loaded
    server. Counted five times a second on a new connection each time, it took a core
    from the workers and slowed a million-job run to half its speed; so the pause after
    a look grows with what the look took (``pause``)."""

    def __init__(self, dsn: str, queries: ChaosQueries) -> None:
        self.dsn = dsn
        self.queries = queries
        self.pause = _WATCH_PAUSE
        self._conn: psycopg.Connection[Any] | None = None

    def counts(self) -> Counter[str] | None:
        """Jobs per status; None while the server is unreachable (a restart)."""
        started = time.monotonic()
        try:
            if self._conn is None or self._conn.closed:
                self._conn = connect(self.dsn, "chaos progress")
            rows = self._conn.execute(self.queries.status_counts, {}).fetchall()
        except psycopg.OperationalError:
            self.close()
            return None
        self.pause = max(_WATCH_PAUSE, _WATCH_SHARE * (time.monotonic() - started))
        return Counter({str(status): int(n) for status, n in rows})

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(psycopg.Error):
                self._conn.close()
            self._conn = None


_JITTER_NOTE = ("the seed replays the same jobs, payloads and fault schedule; timing "
                "(which claim or request a fault meets) is inherently not replayed")
_WORKER_COUNTERS = ("claimed", "done", "retried", "failed", "reconcile", "released",
                    "rescued", "lost_claims", "stale_completions", "reconnects")


def _quiet(message: str) -> None:
    """Discard progress messages."""


def run_chaos(config: ChaosConfig, progress: Progress | None = None) -> ChaosReport:
    """Run the chaos described by ``config``; return the report (``report.ok``).

    Every process, server, thread and database the run starts is stopped or dropped
    before this returns, whatever happens. Worker logs, and the report as JSON, are kept
    (and named in the report) when a violation was found or ``config.keep_logs`` is set.
    """
    say = progress or _quiet
    rng = random.Random(config.seed)
    plan = plan_jobs(config, rng)
    events = build_schedule(config, rng)
    say(f"seed {config.seed}: {len(plan.committed())} jobs, {len(events)} fault events, "
        f"{config.workers} workers, {config.duration:.0f} s of chaos")
    log_dir = Path(tempfile.mkdtemp(prefix="outbox-chaos-logs-"))
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        work_dir = _work_dir(config, stack)
        providers = start_providers(config.provider_latency, config.provider_timeout + 1.0,
                                    config.provider_retention, log_dir)
        stack.callback(providers.close)
        database = provision(config.dsn, work_dir, config.targets,
                             standby="failover" in config.faults)
        stack.callback(release, database)
        run = _Run(config, database, providers, log_dir, say)
        stack.callback(run.pool.cleanup)
        providers.broker.start_consumer(database.dsn, database.schema, database.chaos)
        stack.callback(providers.broker.stop_consumer)
        providers.kafka.start_consumer(database.dsn, database.schema, database.chaos)
        stack.callback(providers.kafka.stop_consumer)
        run.execute(plan, events)
        run.drain_consumer()
        failed_over = run.injector.log.failover_at is not None
        findings = check(database.dsn, run.queries, plan, run.enqueuer.committed, providers,
                         database.targets, failed_over=failed_over)
        groups, over = group_figures(config, plan, database.dsn, run.queries)
        report = _report(config, run, plan, findings, time.monotonic() - started, over)
        report.groups = groups
        report.storage_bytes = run.storage_bytes()
        if "failover" in config.faults:
            report.failover = _failover_figures(config, run, findings)
        if config.targets > 1:
            report.workers.update(_fleet_figures(database.dsn, run.queries))
    if report.ok and not config.keep_logs:
        shutil.rmtree(log_dir, ignore_errors=True)
    else:
        report.log_dir = str(log_dir)
        report.write_json(log_dir / "report.json")
    return report


def _work_dir(config: ChaosConfig, stack: contextlib.ExitStack) -> Path:
    if config.work_dir is not None:
        return Path(config.work_dir)
    return Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="outbox-chaos-")))


class _Run:
    """The moving parts of one run and the order they start and stop in."""

    def __init__(self, config: ChaosConfig, database: Database, providers: Providers,
                 log_dir: Path, say: Progress) -> None:
        self.config = config
        self.database = database
        # Bound to the views over every target; the locks take each target's own.
        self.queries: ChaosQueries = chaos_queries(database.view, database.chaos)
        self.say = say
        self.providers = providers
        self.pool = WorkerPool(_template(config, database, providers), config.workers,
                               log_dir, uuid.uuid4().hex[:6], ready=self._ready)
        self.deadline = time.monotonic() + config.deadline
        self.enqueuer = Enqueuer(database.dsn, database.targets, self.queries, self.deadline)
        self.monitor = LeaseMonitor(database.dsn, self.queries, limits=config.effect_limits,
                                    targets=config.targets)
        self.injector = FaultInjector(config, database, self.queries, self.pool, providers)
        self.stop = threading.Event()
        self.unfinished_threads: list[str] = []
        self.drained = False

    def execute(self, plan: JobPlan, events: Sequence[FaultEvent]) -> None:
        """Bulk enqueue, start the workers, run the chaos phase, drain, stop."""
        bulk = self.enqueuer.run_threads(_groups(plan.bulk), self.stop, time.monotonic())
        self._join(bulk)
        self.say(f"bulk enqueued {len(self.enqueuer.committed)} batches; starting workers")
        self.pool.start_all()
        threads = [
            threading.Thread(target=self.monitor.run, args=(self.stop,), name="chaos-monitor",
                             daemon=True),
            threading.Thread(target=self.injector.run, args=(events, self.stop),
                             name="chaos-injector", daemon=True),
        ]
        for thread in threads:
            thread.start()
        trickle = self.enqueuer.run_threads(_groups(plan.trickle), self.stop, time.monotonic())
        try:
            self.drained = self._wait(threads[1], trickle)
        finally:
            self.stop.set()
            self._join([*threads, *trickle])
            self.injector.finish()
            self.say("stopping workers (SIGTERM)")
            self.pool.stop_all(_STOP_TIMEOUT)

    def drain_consumer(self) -> None:
        """Let the inbox consumers handle what the workers published, then stop them."""
        if not self.providers.broker.wait_consumed(_CONSUMER_DRAIN):
            self.unfinished_threads.append("chaos-consumer (messages left unhandled)")
        self.providers.broker.stop_consumer()
        kafka = self.providers.kafka
        failed_over = self.injector.log.failover_at is not None
        if not kafka.wait_consumed(self.database.dsn, self.database.schema, _CONSUMER_DRAIN,
                                   unstored_ok=failed_over):
            self.unfinished_threads.append(f"the Kafka consumer (messages left unhandled: "
                                           f"{kafka.drain_state})")
        kafka.stop_consumer()

    def _join(self, threads: Sequence[threading.Thread]) -> None:
        limit = time.monotonic() + _JOIN_TIMEOUT
        for thread in threads:
            thread.join(max(0.0, limit - time.monotonic()))
            if thread.is_alive():
                self.unfinished_threads.append(thread.name)

    def _wait(self, injector: threading.Thread, trickle: Sequence[threading.Thread]) -> bool:
        """Until the schedule is over, the trickle committed and no job is left pending
        or running; False if the deadline came first."""
        chaos_end = time.monotonic() + self.config.duration
        next_progress = time.monotonic()
        watch = StatusWatch(self.database.dsn, self.queries)
        try:
            for _ in range(int(self.config.deadline * 10) + 1):  # bounded in count and time
                now = time.monotonic()
                if now > self.deadline:
                    return False
                self.pool.replace_exited()
                counts = watch.counts()
                if now >= next_progress:
                    next_progress = now + _PROGRESS_EVERY
                    self._progress(counts)
                busy = injector.is_alive() or any(t.is_alive() for t in trickle)
                if counts is not None and now >= chaos_end and not busy and \
                        counts["pending"] + counts["running"] == 0:
                    return True
                time.sleep(watch.pause)
            return False
        finally:
            watch.close()

    def _ready(self, worker: WorkerProcess) -> bool:
        """Whether the worker's dispatcher runs: its claimer connection is up (a fleet's
        engines connect only during their turns: a fleet worker writes a file)."""
        if worker.settings.ready_file:
            return Path(worker.settings.ready_file).exists()
        claimer = application_name("claimer", worker.tag)
        try:
            with connect(self.database.dsn, "chaos readiness") as conn:
                rows = conn.execute(self.queries.worker_backends,
                                    {"names": [claimer]}).fetchall()
        except psycopg.OperationalError:
            return False
        return bool(rows)

    def storage_bytes(self) -> int | None:
        """The outbox schemas' relations on disk, in bytes; None if unreachable."""
        try:
            with connect(self.database.dsn, "chaos storage") as conn:
                row = conn.execute(self.queries.schema_storage,
                                   {"schemas": list(self.database.targets)}).fetchone()
        except psycopg.OperationalError:
            return None
        return int(row[0]) if row is not None else None

    def _progress(self, counts: Counter[str] | None) -> None:
        if counts is None:
            self.say("database unreachable (restarting?)")
            return
        log = self.injector.log
        storage = self.storage_bytes()
        size = f"{storage / 2**20:.1f} MiB" if storage is not None else "?"
        self.say(f"done {counts['done']}, failed {counts['failed']}, running "
                 f"{counts['running']}, pending {counts['pending']} | faults injected "
                 f"{sum(log.injected.values())} (kills {log.injected['kill']}, stops "
                 f"{log.armed['stop']}, restarts {log.injected['restart']}) | storage {size} "
                 f"| max overrun {self.monitor.max_overrun:.1f} s")


def _template(config: ChaosConfig, database: Database, providers: Providers) -> WorkerSettings:
    return WorkerSettings(
        dsn=database.dsn, schema=database.schema, chaos=database.chaos, tag="",
        view=database.view, targets=list(database.targets) if config.targets > 1 else [],
        email_url=providers.email.url, stripe_url=providers.stripe.url,
        webhook_url=providers.webhook.url, webhook_secret=WEBHOOK_SECRET,
        nats_url=providers.broker.url, nats_stream=STREAM,
        kafka_bootstrap=providers.kafka.bootstrap_servers, kafka_topic=KAFKA_TOPIC,
        lease=config.lease, rescue_interval=config.rescue_interval,
        concurrency=config.concurrency, provider_timeout=config.provider_timeout,
        limits={effect: {"rate": limit.rate, "burst": limit.burst,
                         "concurrency": limit.concurrency, "per_group": limit.per_group}
                for effect, limit in config.effect_limits.items()},
        wait_for_replicas="failover" in config.faults and config.wait_for_replicas,
    )


def _groups(batches: Sequence[Batch]) -> list[list[Batch]]:
    """Batches grouped by the thread that enqueues them, each group in time order."""
    groups: dict[int, list[Batch]] = {}
    for batch in batches:
        groups.setdefault(batch.thread, []).append(batch)
    return [sorted(group, key=lambda b: b.at) for _, group in sorted(groups.items())]


# -- the report -----------------------------------------------------------------------------


def _report(config: ChaosConfig, run: _Run, plan: JobPlan, findings: Findings,
            elapsed: float, calls_over: list[str]) -> ChaosReport:
    statuses = findings.statuses
    jobs = {
        "planned": len(plan.committed()),
        "committed": sum(statuses.values()),
        "done": statuses["done"],
        "failed": statuses["failed"],
        "reconcile": statuses["reconcile"],
        "lost": statuses["pending"] + statuses["running"],
        "rolled_back": len(plan.rolled_back()),
    }
    faults = _faults(config, run, plan, findings)
    violations, counts = _violations(config, run, findings, faults, calls_over)
    return ChaosReport(
        seed=config.seed, settings=_settings(config), database=run.database.mode,
        elapsed_seconds=round(elapsed, 1), jobs=jobs,
        per_effect={effect: dict(c) for effect, c in findings.per_effect.items()},
        failed_reasons=dict(findings.failed_reasons),
        reconcile_reasons=dict(findings.reconcile_reasons),
        providers=_provider_figures(run), outcomes=dict(findings.outcomes), faults=faults,
        windows=_windows(run), kills=[vars(kill) for kill in run.injector.log.kills],
        workers=_worker_figures(run.pool),
        lease={"max_overrun": round(run.monitor.max_overrun, 3),
               "bound": config.overrun_bound, "worst_key": run.monitor.worst_key,
               "samples": run.monitor.samples, "samples_lost": run.monitor.failed},
        running={"most": dict(run.monitor.most_running),
                 "limit": {effect: limit.concurrency
                           for effect, limit in config.effect_limits.items()
                           if limit.concurrency is not None},
                 "samples_over": run.monitor.over_samples},
        throughput=round(findings.finished_jobs / findings.finished_seconds, 1)
        if findings.finished_seconds else 0.0,
        violations=violations, violation_counts=counts, events=findings.events,
        kafka=findings.kafka,
        notes=_notes(run),
        targets=_target_figures(findings),
    )


def _settings(config: ChaosConfig) -> dict[str, Any]:
    return {
        "workers": config.workers, "jobs": config.jobs, "duration": config.duration,
        "deadline": config.deadline, "lease": config.lease,
        "rescue_interval": config.rescue_interval, "slack": config.slack,
        "concurrency": config.concurrency, "provider_timeout": config.provider_timeout,
        "fault_spacing": config.fault_spacing,
        "faults": sorted(config.faults, key=KNOWN_FAULTS.index),
        "groups": config.groups, "targets": config.targets,
        "limits": {effect: str(limit) for effect, limit in sorted(config.effect_limits.items())},
    }


def _faults(config: ChaosConfig, run: _Run, plan: JobPlan,
            findings: Findings) -> dict[str, dict[str, int]]:
    log = run.injector.log
    armed = Counter(log.armed)
    armed["decline"] = sum(1 for job in plan.committed() if job.decline_code)
    injected = Counter(log.injected)
    for kind in ("5xx", "429", "timeout", "drop", "decline"):
        injected[kind] = findings.observed_faults[kind]
    # A worker killed while its answer was withheld never saw the timeout: count the
    # withheld answers at the fakes too.
    stalled = run.providers.stalled_answers(armed["timeout"])
    injected["timeout"] = max(injected["timeout"], stalled)
    return {kind: {"armed": armed[kind], "injected": injected[kind]}
            for kind in KNOWN_FAULTS if kind in config.faults}


def _failover_figures(config: ChaosConfig, run: _Run, findings: Findings) -> dict[str, Any]:
    """When the primary was killed and the standby promoted, which node the checks read
    (the promoted standby, out of recovery), and what the failover cost: the
    acknowledged orders the new primary lacks, the phantoms (0 with wait_for_replicas)."""
    log = run.injector.log
    server = run.database.server
    figures: dict[str, Any] = {"at": log.failover_at, "seconds": log.failover_seconds,
                               "lag": config.failover_lag,
                               "wait_for_replicas": config.wait_for_replicas}
    if isinstance(server, PairServer):
        if server.failed_over is not None:
            figures["old_primary"], figures["new_primary"] = server.failed_over
        try:
            figures["checked_on"] = server.reached(run.database.dsn)
        except psycopg.OperationalError as exc:
            figures["checked_on"] = f"unreachable: {exc}"
    figures.update(findings.failover)
    figures["kafka_partitions_unstored"] = len(run.providers.kafka.unstored)
    return figures


def _windows(run: _Run) -> dict[str, dict[str, int]]:
    log = run.injector.log
    aimed = Counter(kill.aimed for kill in log.kills)
    seen = Counter(kill.aimed for kill in log.kills if kill.seen)
    hit = log.windows_hit()
    figures = {}
    for window in WINDOWS:
        caught = log.window_jobs[window] if window in log.window_jobs else hit[window]
        figures[window] = {"aimed": aimed[window], "seen": seen[window], "kills": hit[window],
                           "caught": caught}
    plain = [kill for kill in log.kills if kill.aimed == "anytime"]
    figures["anytime"] = {"aimed": len(plain), "seen": len(plain),
                          "kills": sum(1 for kill in plain if kill.hit),
                          "caught": sum(kill.held for kill in plain)}
    return figures


def _target_figures(findings: Findings) -> dict[str, dict[str, int]]:
    """Per target schema: its jobs, their final states, lost and performed twice."""
    return {target: {name: counts[name] for name in
                     ("committed", "done", "failed", "reconcile", "lost", "twice")}
            for target, counts in sorted(findings.per_target.items())}


def _fleet_figures(dsn: str, queries: ChaosQueries) -> dict[str, int]:
    """How many worker processes called providers for jobs of several targets (a fleet
    serves them all) and of one only; empty if the database cannot be reached."""
    try:
        with connect(dsn, "chaos fleet figures") as conn:
            rows = conn.execute(queries.targets_per_worker, {}).fetchall()
    except psycopg.OperationalError:
        return {}
    served = Counter(min(int(targets), 2) for _, targets in rows)
    return {"served_one_target": served[1], "served_several_targets": served[2]}


def _provider_figures(run: _Run) -> dict[str, dict[str, int]]:
    return {name: {"performed": fake.total_performed, "requests": fake.total_requests,
                   "keys": len(fake.performed_keys())} for name, fake in run.providers.items()}


def _worker_figures(pool: WorkerPool) -> dict[str, int]:
    figures = {"started": pool.started, "killed": pool.killed, "reported": len(pool.stats)}
    figures.update({counter: pool.total(counter) for counter in _WORKER_COUNTERS})
    return figures


def _violations(config: ChaosConfig, run: _Run, findings: Findings,
                faults: dict[str, dict[str, int]],
                calls_over: list[str]) -> tuple[dict[str, list[str]], dict[str, int]]:
    violations = {name: findings.violations[name] for name in VIOLATIONS
                  if findings.counts[name]}
    counts = {name: findings.counts[name] for name in VIOLATIONS}
    extra = {
        "lease_overrun": [f"{run.monitor.worst_key}: {run.monitor.max_overrun:.2f} s past its "
                          f"lease (bound {config.overrun_bound:.1f} s)"]
        if run.monitor.max_overrun > config.overrun_bound else [],
        "concurrency_exceeded": [*run.monitor.over, *calls_over],
        "faults_not_injected": missing_faults(faults, run.injector.log.skipped),
        "worker_problems": [*run.pool.problems, *run.providers.kafka.consumer_problems],
        "runner_errors": [*run.injector.log.errors, *run.enqueuer.errors,
                          *(f"thread {name} did not finish" for name in run.unfinished_threads)],
    }
    for name, examples in extra.items():
        counts[name] = len(examples)
        if examples:
            violations[name] = examples[:10]
    return violations, counts


def missing_faults(faults: dict[str, dict[str, int]], skipped: dict[str, str]) -> list[str]:
    """The enabled fault kinds with nothing injected (a kind skipped for a stated reason,
    such as restart on a server the run does not own, excepted)."""
    return [f"{kind}: enabled, armed {counts['armed']}, injected 0"
            for kind, counts in faults.items() if not counts["injected"] and kind not in skipped]


def _notes(run: _Run) -> list[str]:
    log = run.injector.log
    notes = [f"{kind} skipped: {why}" for kind, why in log.skipped.items()]
    notes += log.notes
    if not run.drained:
        notes.append("the deadline came before every job ended")
    if log.restart_seconds:
        took = ", ".join(f"{seconds:.1f}" for seconds in log.restart_seconds)
        notes.append(f"PostgreSQL restarts took {took} s")
    notes.append(f"{log.terminated_backends} dispatcher connections terminated; "
                 f"{log.frozen_jobs} jobs held by frozen workers, {log.stop_fenced} of their "
                 "late writes fenced; "
                 f"{run.enqueuer.retries} enqueue transactions retried after a lost connection")
    if run.providers.broker.consumer_errors:
        notes.append("the inbox consumer was restarted after: "
                     + ", ".join(run.providers.broker.consumer_errors[:5]))
    notes.append(_JITTER_NOTE)
    return notes
