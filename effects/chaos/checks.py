"""The invariants checked once a chaos run has drained, against the database, the audit
and the fake providers' own counts.

Each entry of ``Findings.violations`` must be empty for the run to pass:

``missing_jobs``             a planned, committed job that is not in the jobs table (of
                             the target its batch was enqueued in)
``rolled_back_present``      a job of a rolled-back business transaction that exists, or
                             that a provider performed
``orders_mismatch``          a business row without its jobs' transaction, or the reverse
``lost``                     a committed job not ``done``, ``failed`` or ``reconcile``
``performed_twice``          a key a fake performed more than once
``done_not_once``            a ``done`` job its provider did not perform exactly once
``ledger_missing``           a ``done`` job without its ledger row
``ledger_not_done``          a ledger row whose job is not ``done`` (or does not exist)
``ledger_version_mismatch``  a ledger row whose claim_version or job id is not the job's
``ledger_result_mismatch``   a ledger row naming another provider object than the one the
                             provider made for the key (email id, PaymentIntent id)
``double_claims``            one (key, claim_version) delivered by two workers
``repeated_deliveries``      one (key, claim_version) delivered twice by one worker
``unexpected_failures``      a ``failed`` job that was not a declined card
``decline_mismatches``       a declined card's job not ``failed`` with its decline code,
                             or not attempted exactly once at Stripe
``consumed_not_once``        a job key in the NATS stream or the Kafka topic its inbox
                             consumer did not handle exactly once, or a handling of a key
                             stored nowhere
``dead_lettered``            a message a consumer parked (their handlers never fail)
``kafka_missing``            a ``done`` kafka.produce job with no message in the topic
``kafka_unexplained_repeats``  a key with more messages produced to the topic than the
                             attempts that may have produced one: an attempt that returned
                             (the broker acked; a repeat follows when ``done`` was not
                             recorded under that claim), one that ended UnknownOutcome, or
                             one whose end was never recorded (its worker killed or cut
                             off). An attempt that ended Retry or Permanent produced
                             nothing. Copies of one batch (one partition, one producer
                             timestamp) are one message produced: librdkafka's mock
                             cluster stores an idempotent producer's retried batch again
                             where a broker would not (``effects.chaos.kafka``); they are
                             counted as ``stored_again``.

``phantoms``                 a committed job's effect performed (by its provider, broker or
                             topic) although the job is not in the database: after a
                             failover, an effect for an order the new primary lost

After a failover (the opt-in ``failover`` fault: the primary killed for good, its
asynchronous standby promoted) the database is the new primary, which may lack the last
commits the old one acknowledged. The checks then judge what the new primary holds:
every order (business row) there must have its jobs, each performed once and ended,
none stuck; an effect performed for a job it lacks is a ``phantom`` (0 with
``wait_for_replicas``). What asynchronous replication may lose is counted, not flagged
(``Findings.failover``): ``lost_orders``, batches acknowledged to their enqueuer and
missing on the new primary, and ``lost_order_jobs``, their jobs (neither
``missing_jobs`` nor ``orders_mismatch``, but a phantom if performed);
``handlings_lost``, keys in the stream or the topic whose consumer handling (its inbox
row, committed and acknowledged to the broker on the old primary) the failover lost
(``consumed_not_once`` for 0 handlings only: a key handled twice is still flagged); and
``kafka_repeats_unaudited``, Kafka repeats that the audit rows the failover lost would
have explained (``kafka_unexplained_repeats``). Double claims and repeated deliveries
are judged on the audit rows that survived: a lost row can hide one, never make one.

For ``nats.publish`` jobs, "performed" is the number of messages the stream holds for
the job's key (one subject per key), so ``performed_twice`` and ``done_not_once`` cover
the broker too. For ``kafka.produce`` jobs it is the number of messages the topic holds
with the job's ``outbox-key``: at least once, so a repeat is no violation when an attempt
explains it; the ledger row must name a message of the topic carrying the job's key.

With several targets the jobs and ledger rows of every target are read at once (the
views of ``effects.chaos.database``), a ledger row counting only in its job's target;
``Findings.per_target`` breaks the final states down per target, with the jobs lost and
performed more than once in each.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._sql import ChaosQueries
from .database import connect
from .kafka import ChaosKafka
from .providers import Providers
from .schedule import JobPlan, PlannedJob

__all__ = ["VIOLATIONS", "Findings", "JobRow", "check"]

VIOLATIONS = (
    "missing_jobs", "rolled_back_present", "orders_mismatch", "lost", "performed_twice",
    "done_not_once", "ledger_missing", "ledger_not_done", "ledger_version_mismatch",
    "ledger_result_mismatch", "double_claims", "repeated_deliveries", "unexpected_failures",
    "decline_mismatches", "consumed_not_once", "dead_lettered", "kafka_missing",
    "kafka_unexplained_repeats", "phantoms",
)
# What a lossy failover may cost, counted in ``Findings.failover`` instead of flagged.
_FAILOVER_COUNTS = ("lost_orders", "lost_order_jobs", "phantoms", "handlings_lost",
                    "kafka_repeats_unaudited")
# Effects delivered at least once: repeats are expected (and explained by the checks).
_AT_LEAST_ONCE = frozenset({"kafka.produce"})
_EXAMPLES = 10
# What an adapter's outcome text says about the provider fault behind it.
_FAULT_SIGNS = {
    "5xx": re.compile(r"HTTP 5\d\d"),
    "429": re.compile(r"HTTP 429"),
    "timeout": re.compile(r"ReadTimeout|WriteTimeout"),
    "drop": re.compile(r"RemoteProtocolError|ReadError|disconnected"),
}
_IDS = re.compile(r"\b(pi|ch|re|req)_[0-9A-Za-z]+")
_TERMINAL = ("done", "failed", "reconcile")


@dataclass(frozen=True)
class JobRow:
    """A job as it ended, with its ledger row if any."""

    id: int
    key: str
    effect: str
    status: str
    attempts: int
    claim_version: int
    last_error: str | None
    ledger_job_id: int | None
    ledger_version: int | None
    ledger_result: Any
    target: str = ""  # the outbox schema holding the job


@dataclass
class Findings:
    """What the checks found.

    ``statuses`` counts jobs per final status, ``per_effect`` per effect and status;
    ``failed_reasons`` / ``reconcile_reasons`` group those jobs by their error with keys
    and provider ids elided; ``outcomes`` counts adapter calls by how they ended (``ok``
    or the exception raised); ``observed_faults`` counts the calls whose outcome shows
    a provider fault of each kind (``decline``: jobs failed by a declined card);
    ``finished_jobs`` / ``finished_seconds`` give the throughput (jobs that ended,
    over the seconds from the first enqueue to the last end). ``per_target`` counts per
    target schema its jobs (``committed``), their final states, ``lost`` and ``twice``
    (performed more than once by an effect meant to happen once). ``violations`` maps each
    name of ``VIOLATIONS`` to examples; ``counts`` to how many. ``failed_over`` is set
    when the run failed over (the checks then judge what the new primary holds, see the
    module docstring), and ``failover`` holds what it cost (``lost_orders``, their
    ``lost_order_jobs``, ``phantoms``, ``handlings_lost``, ``kafka_repeats_unaudited``,
    and ``lost_order_examples``); empty otherwise.
    """

    statuses: Counter[str] = field(default_factory=Counter)
    per_effect: dict[str, Counter[str]] = field(default_factory=dict)
    failed_reasons: Counter[str] = field(default_factory=Counter)
    reconcile_reasons: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)
    observed_faults: Counter[str] = field(default_factory=Counter)
    events: dict[str, int] = field(default_factory=dict)
    kafka: dict[str, Any] = field(default_factory=dict)
    per_target: dict[str, Counter[str]] = field(default_factory=dict)
    finished_jobs: int = 0
    finished_seconds: float = 0.0
    failed_over: bool = False
    failover: dict[str, Any] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(VIOLATIONS, 0))
    violations: dict[str, list[str]] = field(
        default_factory=lambda: {name: [] for name in VIOLATIONS})

    def __post_init__(self) -> None:
        if self.failed_over and not self.failover:
            self.failover = dict.fromkeys(_FAILOVER_COUNTS, 0)

    def flag(self, name: str, example: str) -> None:
        """Record one violation of ``name`` (examples are capped)."""
        self.counts[name] += 1
        if len(self.violations[name]) < _EXAMPLES:
            self.violations[name].append(example)

    def scoped(self, name: str, cost: str, example: str) -> None:
        """A violation of ``name``, or after a failover a ``cost`` of it counted in
        ``failover`` (something asynchronous replication may lose)."""
        if self.failed_over:
            self.failover[cost] = self.failover.get(cost, 0) + 1
        else:
            self.flag(name, example)


def check(dsn: str, queries: ChaosQueries, plan: JobPlan, committed_batches: set[str],
          providers: Providers, targets: Sequence[str], failed_over: bool = False) -> Findings:
    """Run every check; see the module docstring. ``targets`` are the outbox schemas, in
    the order ``Batch.target`` numbers them; ``failed_over``: the database is a promoted
    standby, which may lack the old primary's last commits."""
    findings = Findings(failed_over=failed_over)
    providers.kafka.settle()  # the producers have stopped: read the topic to its end once
    with connect(dsn, "chaos checks") as conn:
        rows = [JobRow(*r) for r in conn.execute(queries.final_jobs, {}).fetchall()]
        orphans = [str(r[0]) for r in conn.execute(queries.orphan_ledger_rows, {}).fetchall()]
        repeats = conn.execute(queries.repeated_claims, {}).fetchall()
        outcomes = conn.execute(queries.outcomes, {}).fetchall()
        orders = {str(r[0]) for r in conn.execute(queries.order_names, {}).fetchall()}
        throughput = conn.execute(queries.throughput, {}).fetchone()
        consumed: dict[str, dict[str, int]] = {"nats": {}, "kafka": {}}
        for source, key, count in conn.execute(queries.consumed_counts, {}).fetchall():
            consumed.setdefault(str(source), {})[str(key)] = int(count)
        attempts = conn.execute(queries.kafka_attempts, {}).fetchall()
    by_key = {row.key: row for row in rows}
    _check_intent(findings, plan, committed_batches, by_key, orders, providers)
    _check_phantoms(findings, plan, by_key, providers)
    _check_targets(findings, plan, by_key, targets)
    _check_jobs(findings, rows, plan, providers)
    _check_ledger(findings, rows, orphans, providers)
    _check_claims(findings, repeats)
    _tally_outcomes(findings, outcomes, rows)
    _check_events(findings, providers, consumed["nats"])
    _check_kafka(findings, providers, rows, consumed["kafka"], attempts)
    if throughput is not None:
        findings.finished_jobs, findings.finished_seconds = int(throughput[0]), float(throughput[1])
    return findings


def _check_intent(findings: Findings, plan: JobPlan, committed_batches: set[str],
                  by_key: dict[str, JobRow], orders: set[str], providers: Providers) -> None:
    planned = {job.key for job in plan.committed()}
    lost_batches = _lost_orders(findings, plan, committed_batches, orders)
    lost = {job.key for batch in plan.batches() if batch.name in lost_batches
            for job in batch.jobs}
    for job in plan.committed():
        if job.key in lost:
            continue
        if job.key not in by_key:
            findings.flag("missing_jobs", f"{job.key}: planned and committed, not in jobs")
    for job in plan.rolled_back():
        performed = providers.for_effect(job.effect).performed(job.key)
        if job.key in by_key or performed:
            findings.flag("rolled_back_present", f"{job.key}: rolled back, yet exists "
                                                 f"({job.key in by_key}) or performed {performed}x")
    for key in sorted(set(by_key) - planned):
        findings.flag("rolled_back_present", f"{key}: a job nobody committed")
    for batch in plan.batches():
        exists = batch.name in orders
        if batch.name in lost_batches:
            continue
        if exists != (batch.name in committed_batches) or exists == batch.rollback:
            findings.flag("orders_mismatch", f"{batch.name}: order row {exists}, committed "
                                             f"{batch.name in committed_batches}, "
                                             f"rollback {batch.rollback}")


def _lost_orders(findings: Findings, plan: JobPlan, committed_batches: set[str],
                 orders: set[str]) -> set[str]:
    """After a failover: the orders (batch names) acknowledged to their enqueuer that
    the new primary lacks, counted with their jobs in ``failover``; none otherwise."""
    if not findings.failed_over:
        return set()
    lost = [batch for batch in plan.batches() if not batch.rollback
            and batch.name in committed_batches and batch.name not in orders]
    findings.failover["lost_orders"] = len(lost)
    findings.failover["lost_order_jobs"] = sum(len(batch.jobs) for batch in lost)
    findings.failover["lost_order_examples"] = [batch.name for batch in lost[:_EXAMPLES]]
    return {batch.name for batch in lost}


def _check_phantoms(findings: Findings, plan: JobPlan, by_key: dict[str, JobRow],
                    providers: Providers) -> None:
    """An effect performed for a committed job the database lacks is a phantom (after a
    failover: an order the new primary lost, yet its email sent, its card charged)."""
    for job in plan.committed():
        if job.key in by_key:
            continue
        performed = providers.for_effect(job.effect).performed(job.key)
        if performed:
            findings.flag("phantoms", f"{job.key}: performed {performed}x, no such job in "
                                      "the database")
            if findings.failed_over:
                findings.failover["phantoms"] += 1


def _check_targets(findings: Findings, plan: JobPlan, by_key: dict[str, JobRow],
                   targets: Sequence[str]) -> None:
    """Each committed job in the target its batch was enqueued in, and nowhere else."""
    for batch in plan.batches():
        if batch.rollback:
            continue
        findings.per_target.setdefault(targets[batch.target], Counter())
        for job in batch.jobs:
            row = by_key.get(job.key)
            if row is not None and row.target != targets[batch.target]:
                findings.flag("missing_jobs", f"{job.key}: enqueued in target "
                                              f"{targets[batch.target]}, found in {row.target}")


def _check_jobs(findings: Findings, rows: list[JobRow], plan: JobPlan,
                providers: Providers) -> None:
    declines = {job.key: job for job in plan.committed() if job.decline_code}
    for row in rows:
        findings.statuses[row.status] += 1
        findings.per_effect.setdefault(row.effect, Counter())[row.status] += 1
        performed = providers.for_effect(row.effect).performed(row.key)
        in_target = findings.per_target.setdefault(row.target, Counter())
        in_target["committed"] += 1
        in_target[row.status if row.status in _TERMINAL else "lost"] += 1
        in_target["twice"] += performed > 1 and row.effect not in _AT_LEAST_ONCE
        if row.status not in _TERMINAL:
            findings.flag("lost", f"{row.key}: still {row.status} after {row.attempts} attempts")
        elif row.status == "done" and row.effect in _AT_LEAST_ONCE:
            if performed < 1:
                findings.flag("kafka_missing", f"{row.key}: done, no message in the topic")
        elif row.status == "done" and performed != 1:
            findings.flag("done_not_once", f"{row.key}: done, performed {performed}x")
        elif row.status == "failed":
            findings.failed_reasons[_normalize(row.last_error, row.key)] += 1
        elif row.status == "reconcile":
            findings.reconcile_reasons[_normalize(row.last_error, row.key)] += 1
        decline = declines.get(row.key)
        if decline is not None:
            _check_decline(findings, row, decline, performed)
        elif row.status == "failed":
            findings.flag("unexpected_failures", f"{row.key}: {row.last_error}")
    for _, fake in providers.items():
        for key in fake.performed_keys():
            if fake.performed(key) > 1:
                findings.flag("performed_twice", f"{key}: performed {fake.performed(key)}x")


def _check_events(findings: Findings, providers: Providers, consumed: dict[str, int]) -> None:
    """One message per key in the stream, each handled once by the inbox consumer."""
    stored = providers.broker.messages_per_key()
    for key, count in sorted(stored.items()):
        if count > 1:
            findings.flag("performed_twice", f"{key}: {count} messages in the stream")
        if consumed.get(key, 0) == 0:
            findings.scoped("consumed_not_once", "handlings_lost",
                            f"{key}: stored, handled 0x by the consumer")
        elif consumed[key] != 1:
            findings.flag("consumed_not_once", f"{key}: stored, handled "
                                               f"{consumed.get(key, 0)}x by the consumer")
    for key in sorted(set(consumed) - set(stored)):
        findings.flag("consumed_not_once", f"{key}: handled, not in the stream")
    parked = providers.broker.dead_letters()
    if parked:
        findings.flag("dead_lettered", f"{parked} message(s) on the dead-letter subject")
    stats = providers.broker.consumer_stats
    findings.events = {
        "keys": len(stored), "messages": sum(stored.values()),
        "max_per_key": max(stored.values(), default=0), "handled": sum(consumed.values()),
        "skipped_as_repeats": stats.get("duplicates", 0),
        "handler_retries": stats.get("failed", 0), "dead_lettered": parked,
        "broker_restarts": len(providers.broker.restart_seconds),
    }


def _check_kafka(findings: Findings, providers: Providers, rows: list[JobRow],
                 consumed: dict[str, int], attempts: Iterable[tuple[Any, ...]]) -> None:
    """At least one message per done job, a repeat only where an attempt explains it,
    the ledger naming a message of the job, each key handled once by the consumer."""
    kafka = providers.kafka
    stored = kafka.messages_per_key()
    produced = kafka.produced_per_key()  # a batch the mock stored twice counts once
    producing: Counter[str] = Counter()  # attempts that may have produced a message
    acked_not_done = 0  # attempts the broker acked whose done was never recorded
    for key, version, outcome, final_version, status in attempts:
        if outcome is None or outcome == "ok" or str(outcome).startswith("UnknownOutcome"):
            producing[str(key)] += 1
        if outcome == "ok" and (status != "done" or version != final_version):
            acked_not_done += 1
    for key, count in sorted(stored.items()):
        made = produced.get(key, count)
        if made > producing[key]:
            findings.scoped("kafka_unexplained_repeats", "kafka_repeats_unaudited",
                            f"{key}: {count} messages in the topic, {made} produced apart (not "
                            f"copies of one batch), {producing[key]} attempt(s) that may have "
                            "produced one")
        if consumed.get(key, 0) == 0:
            findings.scoped("consumed_not_once", "handlings_lost",
                            f"{key}: in the topic, handled 0x by the Kafka consumer")
        elif consumed[key] != 1:
            findings.flag("consumed_not_once", f"{key}: in the topic, handled "
                                               f"{consumed.get(key, 0)}x by the Kafka consumer")
    for key in sorted(set(consumed) - set(stored)):
        findings.flag("consumed_not_once", f"{key}: handled, not in the topic")
    _check_kafka_ledger(findings, kafka, rows)
    parked = kafka.dead_letters()
    if parked:
        findings.flag("dead_lettered", f"{parked} message(s) on the Kafka dead-letter topic")
    per_count = Counter(stored.values())
    stats = kafka.consumer_stats
    findings.kafka = {
        "keys": len(stored), "messages": sum(stored.values()),
        "keys_repeated": sum(1 for n in stored.values() if n > 1),
        "max_per_key": max(stored.values(), default=0),
        "keys_per_count": {str(n): per_count[n] for n in sorted(per_count)},
        "stored_again": sum(n - produced.get(key, n) for key, n in stored.items()),
        "acked_not_done": acked_not_done, "handled": sum(consumed.values()),
        "skipped_as_repeats": int(stats.get("duplicates", 0)),
        "handler_retries": int(stats.get("failed", 0)), "dead_lettered": parked,
        "consumer_kills": kafka.consumer_kills, "consumer_stops": kafka.consumer_stops,
        "brokers_down": kafka.brokers_down,
    }


def _check_kafka_ledger(findings: Findings, kafka: ChaosKafka, rows: list[JobRow]) -> None:
    """The ledger row of a done kafka.produce job names a message carrying its key."""
    for row in rows:
        if row.effect != "kafka.produce" or row.status != "done" or row.ledger_job_id is None:
            continue
        result = row.ledger_result if isinstance(row.ledger_result, dict) else {}
        partition, offset = result.get("partition"), result.get("offset")
        if not isinstance(partition, int) or not (offset is None or isinstance(offset, int)):
            findings.flag("ledger_result_mismatch", f"{row.key}: the ledger names {result}")
        elif offset is None:  # acknowledged as a repeat of a stored message: offset unknown
            if row.key not in kafka.keys_in(partition):
                findings.flag("ledger_result_mismatch", f"{row.key}: the ledger names "
                                                        f"partition {partition}, without it")
        elif (at := kafka.key_at(partition, offset)) != row.key:
            findings.flag("ledger_result_mismatch", f"{row.key}: the ledger names {result}, "
                                                    f"which holds {at or 'no message'}")


def _check_decline(findings: Findings, row: JobRow, job: PlannedJob, performed: int) -> None:
    reason = row.last_error or ""
    if row.status != "failed" or f"decline_code={job.decline_code}" not in reason:
        findings.flag("decline_mismatches", f"{row.key}: card declined ({job.decline_code}) "
                                            f"but {row.status}: {reason[:200]}")
    elif performed != 1:
        findings.flag("decline_mismatches", f"{row.key}: declined, attempted {performed}x "
                                            "at Stripe (expected once)")


def _check_ledger(findings: Findings, rows: list[JobRow], orphans: list[str],
                  providers: Providers) -> None:
    made = _provider_ids(providers)
    for row in rows:
        has_ledger = row.ledger_job_id is not None
        if row.status == "done" and not has_ledger:
            findings.flag("ledger_missing", f"{row.key}: done without a ledger row")
        elif has_ledger and row.status != "done":
            findings.flag("ledger_not_done", f"{row.key}: ledger row, job {row.status}")
        if has_ledger and (row.ledger_version, row.ledger_job_id) != (row.claim_version, row.id):
            findings.flag("ledger_version_mismatch",
                          f"{row.key}: ledger (job {row.ledger_job_id}, version "
                          f"{row.ledger_version}), job ({row.id}, version {row.claim_version})")
        expected = made.get(row.key)
        if has_ledger and expected is not None and _result_id(row.ledger_result) != expected:
            findings.flag("ledger_result_mismatch", f"{row.key}: ledger names "
                                                    f"{_result_id(row.ledger_result)}, "
                                                    f"the provider made {expected}")
    for key in orphans:
        findings.flag("ledger_not_done", f"{key}: ledger row without a job")


def _provider_ids(providers: Providers) -> dict[str, str]:
    """key -> the id of what the provider made for it (emails sent, PaymentIntents)."""
    made = {email.key: email.id for email in providers.email.sent_emails if email.key}
    for intent in providers.stripe.payment_intents:
        key = (intent.get("metadata") or {}).get("chaos_key")
        if isinstance(key, str):
            made[key] = str(intent["id"])
    return made


def _result_id(result: Any) -> str | None:
    value = result.get("id") if isinstance(result, dict) else None
    return value if isinstance(value, str) else None


def _check_claims(findings: Findings, repeats: Iterable[tuple[Any, ...]]) -> None:
    for key, version, workers, calls in repeats:
        if workers > 1:
            findings.flag("double_claims", f"{key} version {version}: delivered by "
                                           f"{workers} workers")
        if calls > workers:
            findings.flag("repeated_deliveries", f"{key} version {version}: {calls} calls "
                                                 f"by {workers} worker(s)")


def _tally_outcomes(findings: Findings, outcomes: Iterable[tuple[Any, ...]],
                    rows: list[JobRow]) -> None:
    for _, outcome in outcomes:
        findings.outcomes[str(outcome).split(":", 1)[0]] += 1
        for kind, sign in _FAULT_SIGNS.items():
            if sign.search(outcome):
                findings.observed_faults[kind] += 1
    findings.observed_faults["decline"] = sum(
        1 for row in rows if row.status == "failed" and "card declined" in (row.last_error or ""))


def _normalize(reason: str | None, key: str) -> str:
    """An error with the job's key and provider ids elided, to group alike failures."""
    text = (reason or "(no error recorded)").replace(key, "<key>")
    return _IDS.sub(lambda m: f"{m.group(1)}_...", text)[:300]
