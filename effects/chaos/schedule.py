"""The seeded plan of a chaos run: which jobs are enqueued when, and which faults when.

Pure: everything here is drawn from one ``random.Random(seed)`` and nothing else, so the
same seed and the same sizes give the same jobs, payloads, batches and fault schedule.
What cannot replay exactly is timing (how far the dispatchers got when a fault lands).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, replace
from itertools import cycle
from typing import Any

from effects.testing import DEFAULT_DECLINED_CARDS

from .config import BROKER_FAULTS, PROCESS_FAULTS, ChaosConfig

__all__ = [
    "EFFECTS",
    "KILL_WINDOWS",
    "PROVIDERS",
    "Batch",
    "FaultEvent",
    "JobPlan",
    "PlannedJob",
    "build_schedule",
    "group_name",
    "plan_jobs",
    "subject_for",
]

# effect name -> the fake provider that performs it
EFFECTS = {"email.send": "email", "payment.charge": "stripe", "webhook.post": "webhook",
           "nats.publish": "nats", "kafka.produce": "kafka"}
# The HTTP fakes, where provider faults are armed (the broker has faults of its own).
PROVIDERS = ("email", "stripe", "webhook")
# What a kill aims at: a failure window (see ``windows``); "anytime" is a plain random kill.
KILL_WINDOWS = ("during_claim", "after_claim", "after_provider", "during_done", "anytime")

# The events share is split between NATS and Kafka, so that the HTTP providers see the
# same jobs (and the same draws of the seed) as before Kafka joined.
_EFFECT_WEIGHTS = (0.35, 0.3, 0.2, 0.075, 0.075)
_DECLINE_SHARE = 0.05
_BULK_SHARE = 0.4
_BULK_BATCH = 100
_ROLLBACK_EVERY = 15
# With groups (``ChaosConfig.groups``): the heavy group's share of the jobs, the share
# with no group (a group of its own to the limits), and the priorities some jobs get.
_HEAVY_SHARE = 0.5
_UNGROUPED_SHARE = 0.05
_PRIORITIES = ((10, 0.05), (-5, 0.03))
_APPROVED_CARD = "pm_card_visa"
# Shares of the chaos phase: jobs trickle in until _TRICKLE_END; process faults land in
# [_FAULTS_START, _PROCESS_END], provider faults in [_FAULTS_START, _PROVIDER_END], while
# requests still flow to consume them.
_TRICKLE_END = 0.85
_FAULTS_START = 0.05
_PROCESS_END = 0.85
_PROVIDER_END = 0.7

# kind -> (seconds between events on average, minimum number of events)
_RATES: dict[str, tuple[float, int]] = {
    "kill": (4.0, 5),
    "stop": (15.0, 1),
    "restart": (20.0, 1),
    "terminate": (8.0, 2),
    "5xx": (4.0, 2),
    "429": (5.0, 2),
    "latency": (10.0, 1),
    "timeout": (5.0, 2),
    "drop": (5.0, 2),
    "broker": (15.0, 2),
    # Two windows at least: one may fall while the effect is paused (nothing asked, so
    # nothing refused) and the run must still show the provider pushing back.
    "throttle": (12.0, 2),
    "outage": (25.0, 2),
    # Last, so the kinds above draw from the seed as they did before Kafka joined.
    # Few and short: while a broker is down the Kafka jobs on its partitions hold
    # dispatcher slots, and the HTTP fakes' faults need requests to meet.
    "kafka": (20.0, 2),
    "consumer": (15.0, 2),
    # Opt-in, one per run: the primary is gone for good, its standby promoted.
    "failover": (float("inf"), 1),
}


EVENT_SUBJECTS = "chaos.events"
KAFKA_TOPIC = "chaos-events"


def subject_for(key: str) -> str:
    """The subject a job's event goes to: one per key, so the stream counts per key."""
    return f"{EVENT_SUBJECTS}.{key}"


@dataclass(frozen=True)
class PlannedJob:
    """One job: its key, effect and payload; ``decline_code`` when its card is declined;
    the ``group`` and ``priority`` it is enqueued with."""

    key: str
    effect: str
    payload: dict[str, Any]
    decline_code: str | None = None
    group: str | None = None
    priority: int = 0


@dataclass(frozen=True)
class Batch:
    """One business transaction: a business row plus its jobs, ``at`` seconds after the
    start, by enqueuer ``thread``. A ``rollback`` batch raises inside the transaction,
    so neither its row nor its jobs may ever exist. ``target`` is the index of the
    outbox schema its jobs are enqueued in (0 in a run with one target)."""

    name: str
    at: float
    thread: int
    jobs: tuple[PlannedJob, ...]
    rollback: bool = False
    target: int = 0


@dataclass(frozen=True)
class JobPlan:
    """The bulk batches (enqueued before the dispatchers start) and the trickle."""

    bulk: tuple[Batch, ...]
    trickle: tuple[Batch, ...]

    def batches(self) -> Iterator[Batch]:
        """Every batch, bulk first."""
        yield from self.bulk
        yield from self.trickle

    def committed(self) -> list[PlannedJob]:
        """The jobs of the batches meant to commit."""
        return [job for batch in self.batches() if not batch.rollback for job in batch.jobs]

    def rolled_back(self) -> list[PlannedJob]:
        """The jobs of the batches meant to roll back."""
        return [job for batch in self.batches() if batch.rollback for job in batch.jobs]


@dataclass(frozen=True)
class FaultEvent:
    """One scheduled fault, ``at`` seconds into the chaos phase.

    ``kind`` is a fault kind, or ``cont`` (end of a stop), ``retire`` (the graceful
    stop of a worker that was frozen, to read its counters), ``latency_end``,
    ``kafka_up`` (a Kafka broker set down comes back) or ``consumer_cont`` (the frozen
    Kafka consumer thaws). ``slot``
    names the worker slot for process faults, ``provider`` the fake for provider
    faults; ``count``, ``status``, ``seconds`` and ``window`` are the kind's parameters.
    """

    at: float
    kind: str
    slot: int = 0
    provider: str = ""
    count: int = 0
    status: int = 0
    seconds: float = 0.0
    window: str = ""
    variant: str = ""
    ref: int = 0  # links a stop to its cont and retire, a latency spike to its end


def _payload(effect: str, key: str, n: int, rng: random.Random,
             decline_code: str | None) -> dict[str, Any]:
    if effect == "email.send":
        return {"from": "Chaos <chaos@outbox.example>", "to": f"user{n}@customers.example",
                "subject": f"Chaos order {n}", "text": f"Order {n} is confirmed."}
    if effect == "payment.charge":
        card = _APPROVED_CARD
        if decline_code is not None:
            card = next(pm for pm, code in DEFAULT_DECLINED_CARDS.items() if code == decline_code)
        return {"amount": rng.randrange(100, 20000), "currency": "eur", "customer": f"cus_{n}",
                "payment_method": card, "metadata": {"chaos_key": key}}
    if effect == "nats.publish":
        return {"subject": subject_for(key), "data": {"order": n, "key": key}}
    if effect == "kafka.produce":
        return {"topic": KAFKA_TOPIC, "key": key, "value": {"order": n, "key": key}}
    return {"event": "order.placed", "data": {"order": n, "key": key}}


def _job(n: int, rng: random.Random, decline: bool, prefix: str = "") -> PlannedJob:
    effect = rng.choices(list(EFFECTS), weights=_EFFECT_WEIGHTS)[0]
    key = f"{prefix}{effect}-{n:06d}"
    code = None
    if decline and effect == "payment.charge" and rng.random() < _DECLINE_SHARE:
        code = rng.choice(sorted(set(DEFAULT_DECLINED_CARDS.values())))
    return PlannedJob(key, effect, _payload(effect, key, n, rng, code), code)


def plan_jobs(config: ChaosConfig, rng: random.Random) -> JobPlan:
    """``config.jobs`` committed jobs: a bulk share before the start, the rest trickled
    by ``enqueue_threads`` threads over the first 85% of the chaos phase, with some
    extra batches that roll back."""
    decline = "decline" in config.faults
    jobs = [_job(n, rng, decline) for n in range(config.jobs)]
    if config.groups:
        jobs = _grouped(jobs, config)
    bulk_count = int(len(jobs) * _BULK_SHARE)
    # Smaller bulk batches with several targets, so that each target gets one at least.
    size = min(_BULK_BATCH, max(1, -(-bulk_count // config.targets)))
    bulk = tuple(
        Batch(f"bulk-{i // size}", 0.0, (i // size) % config.enqueue_threads,
              tuple(jobs[i:min(i + size, bulk_count)]))
        for i in range(0, bulk_count, size)
    )
    plan = _spread(JobPlan(bulk, _trickle(config, jobs[bulk_count:], rng)), config.targets)
    keys = [job.key for batch in plan.batches() for job in batch.jobs]
    assert len(keys) == len(set(keys)), "a key planned twice"
    return plan


def _spread(plan: JobPlan, targets: int) -> JobPlan:
    """The batches dealt over ``targets`` outbox schemas in turn (bulk first, then the
    trickle in time order): every target gets a share of each phase, and the same seed
    gives the same targets. Batches keep their jobs, so the plan, its payloads and the
    fault schedule are those of a run with one target."""
    if targets == 1:
        return plan
    bulk = tuple(replace(batch, target=i % targets) for i, batch in enumerate(plan.bulk))
    trickle = tuple(replace(batch, target=(len(bulk) + i) % targets)
                    for i, batch in enumerate(plan.trickle))
    return JobPlan(bulk, trickle)


def group_name(n: int) -> str:
    """The name of the run's ``n``-th group; group 0 is the heavy one."""
    return f"tenant-{n:04d}"


def _grouped(jobs: list[PlannedJob], config: ChaosConfig) -> list[PlannedJob]:
    """The jobs spread over ``config.groups`` groups, half of them in the heavy group 0,
    a few in none, some with a priority. Drawn from a generator of their own, so a run
    with groups has the same jobs, payloads and fault schedule as one without."""
    rng = random.Random(f"chaos-groups-{config.seed}")
    grouped = []
    for job in jobs:
        draw = rng.random()
        group: str | None
        if draw < _UNGROUPED_SHARE:
            group = None
        elif config.groups == 1 or draw < _UNGROUPED_SHARE + _HEAVY_SHARE:
            group = group_name(0)
        else:
            group = group_name(rng.randrange(1, config.groups))
        draw, priority = rng.random(), 0
        for level, share in _PRIORITIES:
            if draw < share:
                priority = level
                break
            draw -= share
        grouped.append(replace(job, group=group, priority=priority))
    return grouped


def _trickle(config: ChaosConfig, jobs: list[PlannedJob], rng: random.Random) -> tuple[Batch, ...]:
    batches: list[Batch] = []
    start, serial = 0, 0
    while start < len(jobs):
        size = rng.randint(1, 20)
        batches.append(Batch(f"trickle-{serial}", 0.0, 0, tuple(jobs[start:start + size])))
        start += size
        serial += 1
        if serial % _ROLLBACK_EVERY == 0:
            doomed = tuple(_job(n, rng, False, prefix="rolled-back-") for n in range(
                serial * 100, serial * 100 + rng.randint(1, 5)))
            batches.append(Batch(f"rollback-{serial}", 0.0, 0, doomed, rollback=True))
    times = sorted(rng.uniform(0.0, _TRICKLE_END * config.duration) for _ in batches)
    return tuple(
        Batch(b.name, at, i % config.enqueue_threads, b.jobs, b.rollback)
        for i, (b, at) in enumerate(zip(batches, times, strict=True))
    )


def build_schedule(config: ChaosConfig, rng: random.Random) -> list[FaultEvent]:
    """The fault events of the chaos phase, in time order. Each enabled kind gets at
    least its minimum number of events, spread at random over the phase (provider
    faults end earlier, so that requests still come to consume them)."""
    events: list[FaultEvent] = []
    windows = list(KILL_WINDOWS)
    rng.shuffle(windows)
    kill_windows = cycle(windows)
    for kind, (every, minimum) in _RATES.items():
        if kind not in config.faults:
            continue
        count = max(minimum, round(config.duration / (every * config.fault_spacing)))
        end = _PROCESS_END if kind in PROCESS_FAULTS + BROKER_FAULTS else _PROVIDER_END
        for _ in range(count):
            at = rng.uniform(_FAULTS_START * config.duration, end * config.duration)
            ref = len(events) + 1
            events.extend(replace(e, ref=ref)
                          for e in _events(kind, at, config, rng, kill_windows))
    return sorted(events, key=lambda event: (event.at, event.kind))


def _events(kind: str, at: float, config: ChaosConfig, rng: random.Random,
            kill_windows: Iterator[str]) -> list[FaultEvent]:
    slot = rng.randrange(config.workers)
    provider = rng.choice(PROVIDERS)
    if kind == "kill":
        return [FaultEvent(at, kind, slot=slot, window=next(kill_windows))]
    if kind == "stop":
        thaw = at + config.stop_seconds
        return [FaultEvent(at, kind, slot=slot, seconds=config.stop_seconds),
                FaultEvent(thaw, "cont", slot=slot),
                FaultEvent(thaw + config.lease + 1.0, "retire", slot=slot)]
    if kind in BROKER_FAULTS:
        return _broker_events(kind, at, rng)
    if kind in ("restart", "terminate", "failover"):
        variant = rng.choice(("one", "all")) if kind == "terminate" else ""
        return [FaultEvent(at, kind, slot=slot, variant=variant)]
    return _provider_events(kind, at, provider, rng)


def _broker_events(kind: str, at: float, rng: random.Random) -> list[FaultEvent]:
    """A broker fault; one that lasts a while ends with an event of its own, so that the
    schedule goes on meanwhile."""
    if kind == "kafka":  # one broker down for a while (slot + 1 names it)
        event = FaultEvent(at, kind, slot=rng.randrange(3), variant="down",
                           seconds=round(rng.uniform(0.5, 1.5), 2))
        return [event, replace(event, at=at + event.seconds, kind="kafka_up")]
    if kind == "consumer":  # the Kafka consumer process killed, or frozen for a while
        event = FaultEvent(at, kind, variant=rng.choice(("kill", "stop")),
                           seconds=round(rng.uniform(1.0, 4.0), 2))
        ends = [replace(event, at=at + event.seconds, kind="consumer_cont")]
        return [event, *ends] if event.variant == "stop" else [event]
    return [FaultEvent(at, kind, variant=rng.choice(("kill", "stop")),
                       seconds=round(rng.uniform(0.5, 2.0), 2))]


def _provider_events(kind: str, at: float, provider: str,
                     rng: random.Random) -> list[FaultEvent]:
    if kind == "5xx":
        return [FaultEvent(at, kind, provider=provider, count=rng.randint(3, 8),
                           status=rng.choice((500, 502, 503)))]
    if kind == "429":
        return [FaultEvent(at, kind, provider=provider, count=rng.randint(2, 5), status=429,
                           seconds=1.0)]
    if kind in ("throttle", "outage"):
        # throttle: the provider admits ``seconds`` requests/s for a while; outage: it
        # answers 503 to everything for a while.
        end = at + rng.uniform(1.0, 4.0)
        rate = round(rng.uniform(0.5, 2.0), 1) if kind == "throttle" else 0.0
        return [FaultEvent(at, kind, provider=provider, seconds=rate),
                FaultEvent(end, f"{kind}_end", provider=provider)]
    if kind == "latency":
        spike = round(rng.uniform(0.2, 0.6), 3)
        end = at + rng.uniform(1.0, 3.0)
        return [FaultEvent(at, kind, provider=provider, seconds=spike),
                FaultEvent(end, "latency_end", provider=provider)]
    variant = rng.choice(("before", "after")) if kind == "drop" else ""
    return [FaultEvent(at, kind, provider=provider, count=rng.randint(1, 3), variant=variant)]
