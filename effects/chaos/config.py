"""What a chaos run is asked to do: sizes, timings, and the fault kinds to inject."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from outbox import Limit
from outbox.limits import parse_limit

__all__ = ["BROKER_FAULTS", "FAULT_KINDS", "GROUP_LIMITS", "KNOWN_FAULTS", "LIMITED_EFFECTS",
           "MAX_TARGETS", "OPT_IN_FAULTS", "PROCESS_FAULTS", "PROVIDER_FAULTS", "ChaosConfig",
           "parse_faults", "parse_limits"]

# Faults against the dispatcher processes and the database.
PROCESS_FAULTS = ("kill", "stop", "restart", "terminate")
# Faults at the fake providers ("decline" is a property of some jobs' payment methods;
# "throttle" puts a provider under a rate limit for a while, "outage" answers every
# request 503 for a while).
PROVIDER_FAULTS = ("5xx", "429", "latency", "timeout", "drop", "decline", "throttle", "outage")
# Faults at the brokers: the NATS server killed or stopped, then started again on the
# same store ("broker"); a Kafka broker set down for a while ("kafka"); the Kafka
# consumer process killed or frozen ("consumer").
BROKER_FAULTS = ("broker", "kafka", "consumer")
FAULT_KINDS = PROCESS_FAULTS + PROVIDER_FAULTS + BROKER_FAULTS
# Faults a run injects only when named (``--faults failover,kill``), never in "all" nor
# by default: "failover" runs the database as a primary and an asynchronous streaming
# standby, kills the primary for good mid-run and promotes the standby; the dispatchers
# run with wait_for_replicas=True. It loses acknowledged orders (asynchronous
# replication allows it), so the checks are scoped to what the new primary holds
# (effects.chaos.checks): kept out of the default set, whose checks hold in full.
OPT_IN_FAULTS = ("failover",)
KNOWN_FAULTS = FAULT_KINDS + OPT_IN_FAULTS
# The effects a run may limit (``--limit``): those of the run's mix.
LIMITED_EFFECTS = ("email.send", "payment.charge", "webhook.post", "nats.publish",
                   "kafka.produce")
# The workers' limits when a run has groups and no ``--limit``: at most 2 webhooks of a
# group in flight, and 25 emails a second per group (the heavy group's half of the emails
# is held back by it at the start of a run and catches up during it).
GROUP_LIMITS: Mapping[str, Limit] = {
    "email.send": Limit(rate=25.0, per_group=True),
    "webhook.post": Limit(concurrency=2, per_group=True),
}

# The most outbox schemas a run spreads its jobs over (``--targets``): each target's job
# ids start at a distinct multiple of TARGET_ID_SPAN (effects.chaos.database), and a
# fleet dispatcher runs a few turns at once within its default connection budget.
MAX_TARGETS = 8


def parse_faults(text: str) -> frozenset[str]:
    """``"kill,5xx"`` as a set of fault kinds; ``"all"`` or ``""`` means every kind
    but the opt-in ones (``OPT_IN_FAULTS``), ``"none"`` no fault at all. Unknown names
    raise ValueError naming the valid ones."""
    names = {part.strip() for part in text.split(",") if part.strip()}
    if not names or names == {"all"}:
        return frozenset(FAULT_KINDS)
    if names == {"none"}:
        return frozenset()
    unknown = sorted(names - set(KNOWN_FAULTS))
    if unknown:
        raise ValueError(f"unknown fault kind(s) {', '.join(unknown)}; "
                         f"choose from {', '.join(KNOWN_FAULTS)}")
    return frozenset(names)


def parse_limits(specs: tuple[str, ...] | list[str]) -> dict[str, Limit]:
    """``["email.send=25/s,per_group", "webhook.post=concurrency=2,per_group"]`` as a map
    of effect -> ``outbox.Limit`` (the form of ``outbox run --limit``); ``none`` alone
    means no limit. ValueError names what is wrong."""
    if list(specs) == ["none"]:
        return {}
    limits: dict[str, Limit] = {}
    for spec in specs:
        effect, sep, text = spec.partition("=")
        effect = effect.strip()
        if not sep or effect not in LIMITED_EFFECTS:
            raise ValueError(f"give a limit as EFFECT=LIMIT with EFFECT one of "
                             f"{', '.join(LIMITED_EFFECTS)}; got {spec!r}")
        if effect in limits:
            raise ValueError(f"{effect} is limited twice")
        limits[effect] = parse_limit(text)
    return limits


@dataclass(frozen=True)
class ChaosConfig:
    """One chaos run.

    ``duration`` is the chaos phase in seconds: faults are injected and jobs enqueued
    during it. ``deadline`` bounds the whole run from the first enqueue: committed jobs
    not finished by then count as lost. ``lease`` and ``rescue_interval`` configure the
    dispatchers; ``slack`` is the allowance, on top of both, for a job to stay
    ``running`` past its lease (restart downtime, reconnect backoff, a loaded machine).
    ``dsn`` runs on an existing server in a database (or schemas) of the run's own,
    dropped afterwards; without it an embedded PostgreSQL is started in ``work_dir``
    (a temporary directory of its own when None; a given one must stay traversable by
    the server's user for the whole run: pytest's ``tmp_path`` is not, as pytest resets
    ``/tmp/pytest-of-<user>`` to mode 0700 whenever another session starts).
    ``provider_retention`` is how long the fakes remember an idempotency key (24 hours,
    as Stripe and Resend): shorten it to see what a provider that forgets keys early
    does to "once" (the checks catch it).
    ``failover_lag`` and ``wait_for_replicas`` shape the opt-in ``failover`` fault (a
    primary and its streaming standby, the primary killed mid-run): the seconds the
    standby's WAL receipt is stalled before the kill, and whether the workers wait for
    the standby before performing (``Dispatcher(wait_for_replicas=True)``).
    ``targets`` above 1 makes each worker one fleet dispatcher
    (``Dispatcher(effects=..., targets=[...])``) over that many outbox schemas of the
    run's database, the jobs' batches spread over them.
    """

    workers: int = 3
    jobs: int = 3000
    duration: float = 40.0
    deadline: float = 240.0
    seed: int = 0
    dsn: str | None = None
    faults: frozenset[str] = field(default_factory=lambda: frozenset(FAULT_KINDS))
    lease: float = 2.0
    rescue_interval: float = 1.0
    slack: float = 8.0
    # Seconds between faults of each kind, as a multiple of the CI intensity (_RATES in
    # schedule.py: a kill every 4 s, a restart every 20 s, ...). A soak of an hour or a
    # million jobs runs sparser faults (10: a kill every 40 s) so that work gets done
    # between them; every kind still comes at least its minimum number of times.
    fault_spacing: float = 1.0
    concurrency: int = 8
    provider_timeout: float = 1.0
    provider_latency: float = 0.01
    provider_retention: float = 24 * 60 * 60.0
    enqueue_threads: int = 4
    work_dir: str | None = None
    keep_logs: bool = False
    groups: int = 0
    limits: Mapping[str, Limit] | None = None
    targets: int = 1
    # The failover fault: the standby's WAL receipt is stalled this many seconds before
    # the primary is killed (the commits of those seconds are lost), and the workers run
    # with wait_for_replicas (False: effects are performed for orders the failover then
    # loses, phantoms, which the checks flag).
    failover_lag: float = 2.0
    wait_for_replicas: bool = True

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError("workers must be at least 1")
        if self.jobs < 10:
            raise ValueError("jobs must be at least 10")
        if self.duration <= 0 or self.deadline <= self.duration:
            raise ValueError("duration must be positive and deadline longer than duration")
        if self.lease < 1.0:
            raise ValueError("lease must be at least 1 second")
        if not 0.1 <= self.fault_spacing <= 1000:
            raise ValueError("fault spacing must be between 0.1 and 1000")
        unknown = self.faults - set(KNOWN_FAULTS)
        if unknown:
            raise ValueError(f"unknown fault kind(s): {', '.join(sorted(unknown))}")
        if "failover" in self.faults and self.dsn is not None:
            raise ValueError("the failover fault needs a primary and standby of the run's "
                             "own: not with --dsn")
        if "failover" in self.faults and not 0 <= self.failover_lag <= self.duration / 2:
            raise ValueError("failover lag must be between 0 and half the duration")
        if "failover" in self.faults and self.targets > 1:
            raise ValueError("the failover fault runs with one target")
        if not 0 <= self.groups <= 10_000:
            raise ValueError("groups must be between 0 and 10000")
        if not 1 <= self.targets <= MAX_TARGETS:
            raise ValueError(f"targets must be between 1 and {MAX_TARGETS}")
        strange = sorted(set(self.limits or {}) - set(LIMITED_EFFECTS))
        if strange:
            raise ValueError(f"no such effect in the run to limit: {', '.join(strange)}")

    @property
    def effect_limits(self) -> dict[str, Limit]:
        """The limits the workers declare: ``limits``, or by default ``GROUP_LIMITS`` in a
        run with groups and none without."""
        if self.limits is not None:
            return dict(self.limits)
        return dict(GROUP_LIMITS) if self.groups else {}

    @property
    def overrun_bound(self) -> float:
        """The longest a job may stay ``running`` past its lease: lease + rescue + slack."""
        return self.lease + self.rescue_interval + self.slack

    @property
    def stop_seconds(self) -> float:
        """How long a SIGSTOP lasts: past the lease and one rescue round, so the frozen
        worker's claims are taken over before it wakes."""
        return self.lease + self.rescue_interval + 1.5
