"""Carrying out the fault schedule, and recording what each fault actually did.

Kills are aimed at failure windows and judged afterwards (``effects.chaos.windows``);
a killed worker is replaced at once. A stop freezes the busiest worker (SIGSTOP) past
its lease and one rescue round, thaws it (SIGCONT) so its late writes meet the fence,
then retires it (SIGTERM) to collect its counters: ``stale_completions`` and
``lost_claims`` are those fenced late writes. Restarts and terminations cut every
dispatcher connection (or one worker's); provider faults are armed at the fakes; a
broker fault kills or stops the NATS server and starts it again; a kafka fault sets a
Kafka broker down for a while; a
consumer fault kills -9 the Kafka consumer process (a successor starts at once) or
freezes it (SIGSTOP) for a while. A failover kills the primary for good and promotes
its streaming standby (``effects.chaos.standby``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from effects.testing import FakeProvider
from effects.testing._faults import Failure, PostFault, PreFault, fault_kind

from ._sql import ChaosQueries, chaos_queries
from .config import ChaosConfig
from .database import Database
from .pool import WorkerPool, WorkerProcess
from .providers import Providers
from .schedule import PROVIDERS, FaultEvent
from .windows import AIM_SECONDS, Aimer, died_inside, statement_windows

__all__ = ["FaultInjector", "FaultLog", "KillRecord", "disarm_unmet"]

log = logging.getLogger("effects.chaos")

_RETIRE_TIMEOUT = 30.0
# How long a terminate keeps asking for a worker backend to end.
_TERMINATE_SECONDS = 3 * AIM_SECONDS
# How long a throttle, outage or latency window no request met stays in force past its
# end: it stays armed until a request met it (a loaded machine sends fewer requests than the
# rate admits; the effect may be paused), without holding up the rest of the schedule.
_PUSH_BACK_LINGER = 60.0


@dataclass
class KillRecord:
    """One kill: when (seconds into the chaos phase), whom, the window it aimed at,
    whether the worker was seen in it just before, the windows it hit, and how many
    jobs the worker still held when it died."""

    at: float
    tag: str
    aimed: str
    seen: bool
    hit: list[str]
    held: int


@dataclass
class FaultLog:
    """What the injector did.

    ``armed`` counts events carried out per kind (for provider faults: the requests
    armed to be spoiled). ``injected`` counts evidence that a fault took effect: kills
    sent, stops that outlasted the lease, restarts completed, terminate rounds that
    ended at least one backend, requests slowed by a latency spike (the other provider
    faults are counted from what the adapters saw, in the checks). ``frozen_jobs`` are
    the jobs frozen workers held; ``stop_fenced`` the late writes their counters show
    fenced (stale completions + lost claims) once retired.
    """

    armed: Counter[str] = field(default_factory=Counter)
    injected: Counter[str] = field(default_factory=Counter)
    kills: list[KillRecord] = field(default_factory=list)
    window_jobs: Counter[str] = field(default_factory=Counter)
    terminated_backends: int = 0
    restart_seconds: list[float] = field(default_factory=list)
    frozen_jobs: int = 0
    stop_fenced: int = 0
    skipped: dict[str, str] = field(default_factory=dict)
    failover_at: float | None = None  # seconds into the chaos phase
    failover_seconds: float | None = None  # the kill and the promotion
    notes: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def windows_hit(self) -> Counter[str]:
        """Kills that hit each window."""
        return Counter(window for kill in self.kills for window in kill.hit)


def disarm_unmet(fakes: Mapping[str, FakeProvider], provider: str,
                 armed_kinds: Collection[str]) -> int:
    """Drop the faults armed at ``provider`` that no request met; how many. A burst of
    errors belongs to its moment: what the last one left unmet (the dispatchers paused
    the effect, its breaker open) is not queued for whichever probe comes next. Except
    a kind (of ``armed_kinds``, the fakes' names) no request has met at any of
    ``fakes`` yet: it stays armed until one does, or a run could end with a fault
    enabled and never injected."""
    never_met = {kind for kind in armed_kinds
                 if not any(fake.faults_met(kind) for fake in fakes.values())}
    return fakes[provider].disarm_pending(keep=never_met)


class FaultInjector:
    """Runs the schedule on its own thread: ``run(events, stop)``, then ``finish()``."""

    def __init__(self, config: ChaosConfig, database: Database, queries: ChaosQueries,
                 pool: WorkerPool, providers: Providers) -> None:
        self._config = config
        self._database = database
        self._queries = queries
        self._pool = pool
        self._providers = providers
        # A fleet worker's engines each hold up to concurrency jobs, one per target.
        self._aimer = Aimer(database.dsn, queries, providers,
                            config.concurrency * len(database.targets),
                            [chaos_queries(target, database.chaos)
                             for target in database.targets])
        self._frozen: dict[int, tuple[WorkerProcess, float]] = {}  # by the stop's ref
        self._thawed: dict[int, WorkerProcess] = {}
        self._spikes: dict[int, tuple[str, int]] = {}  # by ref: (provider, requests then)
        # (kind, provider) -> the fake's (throttled, outage_requests) when it began
        self._disarmed = 0  # unmet provider faults dropped when the next was armed
        self._armed_kinds: set[str] = set()  # the fakes' fault kinds armed in this run
        self._push_backs: dict[tuple[str, str], tuple[int, int]] = {}
        # (kind, provider) -> until when a window past its end, unmet, stays in force
        self._lingering: dict[tuple[str, str], float] = {}
        self._lingering_spikes: dict[int, float] = {}  # by ref, likewise
        self._retiring: list[threading.Thread] = []
        self._kafka_down: dict[int, int] = {}  # by the fault's ref: the broker set down
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self.log = FaultLog()
        if "restart" in config.faults and not database.restartable:
            self.log.skipped["restart"] = "the --dsn server is not the run's own: not restarted"

    # -- the loop ---------------------------------------------------------------------------

    def run(self, events: Sequence[FaultEvent], stop: threading.Event) -> None:
        """Carry out ``events`` at their times (seconds after this call), until ``stop``."""
        self._started = time.monotonic()
        for event in events:
            if self._wait_settling(self._started + event.at, stop):
                return
            try:
                self._execute(event)
            except Exception as exc:  # a fault that failed to fire is reported, not fatal
                self.log.errors.append(f"{event.kind} at {event.at:.1f}s: "
                                       f"{type(exc).__name__}: {exc}")
                self._aimer.close()
        # The schedule is over: errors armed at a provider and not yet met go too. Left
        # armed, they would fail the probes of an effect whose breaker the burst opened,
        # one per probe interval, long after the provider's bad moment.
        for name in PROVIDERS:
            self._disarm(name)
        while (self._lingering or self._lingering_spikes) and not stop.wait(0.1):
            self._settle_push_backs()

    def _wait_settling(self, until: float, stop: threading.Event) -> bool:
        """Wait until ``until`` (a monotonic time), ending the lingering push-back windows
        that a request met meanwhile; True if ``stop`` was set."""
        while True:
            self._settle_push_backs()
            left = until - time.monotonic()
            if left <= 0:
                return stop.is_set()
            if stop.wait(min(left, 0.1)):
                return True

    def finish(self) -> None:
        """Undo what is still in force: thaw frozen workers, end latency spikes, wait
        for retiring workers."""
        for worker, _ in self._frozen.values():
            self._pool.thaw(worker)
        self._frozen.clear()
        for ref in list(self._spikes):
            self._end_latency(ref)
        self._lingering_spikes.clear()
        for ref in list(self._kafka_down):
            self._kafka_up(FaultEvent(0.0, "kafka_up", ref=ref))
        self._providers.kafka.thaw_consumer()
        for kind, provider in list(self._push_backs):
            self._close_push_back(kind, provider)
        self._lingering.clear()
        if self._disarmed:
            self.log.notes.append(f"{self._disarmed} provider fault(s) no request met (before "
                                  "the next was armed, or by the schedule's end) were disarmed")
        for thread in self._retiring:
            thread.join(_RETIRE_TIMEOUT + 30.0)
            if thread.is_alive():
                self.log.errors.append(f"{thread.name} did not finish")
        self._aimer.close()

    def _execute(self, event: FaultEvent) -> None:
        handlers: dict[str, Callable[[FaultEvent], None]] = {
            "kill": self._kill, "stop": self._stop, "cont": self._cont,
            "retire": self._retire, "restart": self._restart, "terminate": self._terminate,
            "latency": self._latency, "latency_end": self._latency_ends,
            "broker": self._broker, "kafka": self._kafka, "consumer": self._consumer,
            "kafka_up": self._kafka_up, "consumer_cont": self._consumer_cont,
            "throttle": self._push_back, "outage": self._push_back,
            "throttle_end": self._end_push_back, "outage_end": self._end_push_back,
            "failover": self._failover,
        }
        handler = handlers.get(event.kind, self._provider_fault)
        handler(event)

    # -- kills --------------------------------------------------------------------------------

    def _kill(self, event: FaultEvent) -> None:
        worker = self._pool.pick(event.slot, min_age=self._config.lease)
        if worker is None:
            self.log.notes.append(f"kill at {event.at:.1f}s skipped: no worker free")
            return
        at = time.monotonic() - self._started
        with self._aimer.aim(worker, event.window) as (before, seen):
            self._pool.kill(worker)
            try:
                after = self._aimer.backends(worker)
            finally:
                self._pool.replace(worker)
        self.log.armed["kill"] += 1
        self.log.injected["kill"] += 1
        hit = [w for w in statement_windows() if died_inside(w, worker.tag, before, after)]
        held = self._aimer.left_behind(worker)
        self.log.window_jobs.update(held)
        hit += [window for window, jobs in held.items() if jobs]
        self.log.kills.append(KillRecord(round(at, 2), worker.tag, event.window, seen, hit,
                                         sum(held.values())))

    # -- stops --------------------------------------------------------------------------------

    def _stop(self, event: FaultEvent) -> None:
        awake = [w for w in self._pool.live() if not w.frozen and not w.doomed]
        if len(awake) < 2:  # keep one worker awake to rescue the frozen one's jobs
            self.log.notes.append(f"stop at {event.at:.1f}s skipped: no worker to spare")
            return
        worker, held = self._busiest(awake, event.slot)
        self.log.frozen_jobs += held
        self._pool.freeze(worker)
        self._frozen[event.ref] = (worker, time.monotonic())
        self.log.armed["stop"] += 1

    def _busiest(self, awake: list[WorkerProcess], slot: int) -> tuple[WorkerProcess, int]:
        """The awake worker holding the most jobs (waiting, bounded, for one to hold
        any: freezing an idle worker tests little); ties go to ``slot`` onwards."""
        order = sorted(awake, key=lambda w: (w.slot - slot) % self._config.workers)
        deadline = time.monotonic() + AIM_SECONDS
        held: dict[str, int] = {}
        for _ in range(1000):  # bounded in count as well as in time
            held = {w.tag: len(self._aimer.held(w)) for w in order}
            if any(held.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        worker = max(order, key=lambda w: held.get(w.tag, 0))
        return worker, held.get(worker.tag, 0)

    def _cont(self, event: FaultEvent) -> None:
        frozen = self._frozen.pop(event.ref, None)
        if frozen is None:
            return  # the stop was skipped
        worker, since = frozen
        # The freeze is the fault only once it outlived the lease; on a loaded machine
        # the stop itself may have landed late (it waits for a busy worker), so hold it
        # for the rest of the lease rather than thaw it early.
        held_for = time.monotonic() - since
        if held_for < self._config.lease:
            time.sleep(self._config.lease - held_for)  # the point is a stall past the lease
        worker.doomed = True  # awaits its graceful stop: no other fault may take it
        self._pool.thaw(worker)
        if worker.proc.poll() is None:
            self.log.injected["stop"] += 1
        self._thawed[event.ref] = worker

    def _retire(self, event: FaultEvent) -> None:
        worker = self._thawed.pop(event.ref, None)
        if worker is None:
            return
        thread = threading.Thread(target=self._retire_worker, args=(worker,),
                                  name=f"chaos-retire-{event.slot}", daemon=True)
        thread.start()  # a graceful stop takes a while: the schedule goes on meanwhile
        self._retiring.append(thread)

    def _retire_worker(self, worker: WorkerProcess) -> None:
        stats = self._pool.retire(worker, _RETIRE_TIMEOUT)
        if stats is not None:
            with self._lock:
                self.log.stop_fenced += int(stats.get("stale_completions", 0)
                                            + stats.get("lost_claims", 0))

    # -- the database -------------------------------------------------------------------------

    def _restart(self, event: FaultEvent) -> None:
        if not self._database.restartable:
            return
        self._aimer.close()
        self.log.armed["restart"] += 1
        self.log.restart_seconds.append(round(self._database.restart(), 2))
        self.log.injected["restart"] += 1

    def _failover(self, event: FaultEvent) -> None:
        """Stall the standby's WAL receipt for ``failover_lag`` seconds, then kill the
        primary for good (every process, SIGKILL) and promote the standby: the workers,
        enqueuers and consumers find it through the multi-host DSN."""
        if not self._database.can_fail_over:
            return
        self._aimer.close()
        self.log.armed["failover"] += 1
        at = time.monotonic() - self._started
        lag = self._config.failover_lag
        took = self._database.fail_over(lag)
        self.log.failover_at = round(at + lag, 2)
        self.log.failover_seconds = round(took, 2)
        self.log.injected["failover"] += 1
        self.log.notes.append(f"failover at {at + lag:.1f}s: the standby's WAL stalled from "
                              f"{at:.1f}s, then the primary killed (SIGKILL) and the standby "
                              f"promoted in {took:.1f} s")
        # The Kafka inbox seeks to the offsets PostgreSQL holds only when partitions are
        # assigned: after a lossy failover a running consumer reads on from its own
        # position, past the messages whose handlings the new primary lost. Restarted
        # (as an operator must), its successor seeks to the new primary's offsets.
        if self._providers.kafka.kill_consumer():
            self.log.notes.append("the Kafka consumer restarted after the failover, to seek "
                                  "to the offsets the new primary holds")

    def _terminate(self, event: FaultEvent) -> None:
        if event.variant == "one":
            worker = self._pool.pick(event.slot, min_age=self._config.lease)
            workers = [] if worker is None else [worker]
        else:
            workers = self._pool.live()
        names = [name for w in workers for name in w.settings.application_names()]
        # Workers just started (or reconnecting after a restart) may have no backend
        # yet: ask again until one was ended, within a bound.
        deadline = time.monotonic() + _TERMINATE_SECONDS
        ended = 0
        for _ in range(1000):  # bounded in count as well as in time
            (ended,) = self._aimer.query(self._queries.terminate_backends, {"names": names})[0]
            if ended or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        self.log.armed["terminate"] += 1
        self.log.terminated_backends += int(ended)
        if ended:
            self.log.injected["terminate"] += 1

    # -- the broker ---------------------------------------------------------------------------

    def _broker(self, event: FaultEvent) -> None:
        """Kill or stop the NATS server and start it again, clients connected."""
        self.log.armed["broker"] += 1
        took = self._providers.broker.restart(event.variant, event.seconds)
        self.log.injected["broker"] += 1
        self.log.notes.append(f"broker {event.variant} at {event.at:.1f}s, back in {took:.1f} s")

    def _kafka(self, event: FaultEvent) -> None:
        """One Kafka broker down, until its ``kafka_up``. (Errors pushed onto Produce
        requests are not used: librdkafka then takes some messages the mock never
        stored for stored, which no broker does; see ``effects.testing._kafka``.)"""
        kafka = self._providers.kafka
        self.log.armed["kafka"] += 1
        broker = kafka.cluster.broker_ids[event.slot % kafka.cluster.brokers]
        if broker in self._kafka_down.values():
            return  # down already
        kafka.broker_down(broker)
        self._kafka_down[event.ref] = broker
        self.log.notes.append(f"kafka broker {broker} down at {event.at:.1f}s for "
                              f"{event.seconds:.1f} s")

    def _kafka_up(self, event: FaultEvent) -> None:
        broker = self._kafka_down.pop(event.ref, None)
        if broker is not None:
            self._providers.kafka.broker_up(broker)
            self.log.injected["kafka"] += 1

    def _consumer(self, event: FaultEvent) -> None:
        """kill -9 the Kafka consumer process (its successor starts at once), or
        freeze it (until its ``consumer_cont``)."""
        kafka = self._providers.kafka
        self.log.armed["consumer"] += 1
        done = kafka.kill_consumer() if event.variant == "kill" else kafka.freeze_consumer()
        if done:
            self.log.injected["consumer"] += 1

    def _consumer_cont(self, event: FaultEvent) -> None:
        self._providers.kafka.thaw_consumer()

    # -- providers ----------------------------------------------------------------------------

    def _provider_fault(self, event: FaultEvent) -> None:
        fake = self._providers.by_name(event.provider)
        self._disarm(event.provider)
        if event.kind in ("5xx", "429"):
            retry_after = event.seconds if event.kind == "429" else None
            fake.fail_next(event.count, event.status, retry_after=retry_after)
            armed = fault_kind(Failure(event.status))
        elif event.kind == "timeout":
            fake.succeed_then_timeout(event.count)
            armed = fault_kind(PostFault.STALL)
        elif event.kind == "drop" and event.variant == "before":
            fake.drop_connection(event.count)
            armed = fault_kind(PreFault.DROP)
        elif event.kind == "drop":
            fake.succeed_then_drop(event.count)
            armed = fault_kind(PostFault.DROP)
        else:
            raise ValueError(f"unknown fault kind {event.kind!r}")
        self._armed_kinds.add(armed)
        self.log.armed[event.kind] += event.count

    def _disarm(self, provider: str) -> None:
        fakes = {name: self._providers.by_name(name) for name in PROVIDERS}
        self._disarmed += disarm_unmet(fakes, provider, self._armed_kinds)

    def _push_back(self, event: FaultEvent) -> None:
        """A rate limit (throttle) or an outage at one provider until its end event;
        what it refused is counted at the fake when it ends. A window already in force
        there goes on (from its own start) until this one's end."""
        fake = self._providers.by_name(event.provider)
        if event.kind == "throttle":
            fake.set_rate_limit(event.seconds)
        else:
            fake.set_outage(True)
        self._push_backs.setdefault((event.kind, event.provider),
                                    (fake.throttled, fake.outage_requests))
        self._lingering.pop((event.kind, event.provider), None)
        self.log.armed[event.kind] += 1

    def _end_push_back(self, event: FaultEvent) -> None:
        """Close the window if a request met it; otherwise it stays armed (bounded) until
        one does: ``_settle_push_backs`` closes it then."""
        kind = event.kind.removesuffix("_end")
        if (kind, event.provider) not in self._push_backs:
            return
        if self._push_back_met(kind, event.provider):
            self._close_push_back(kind, event.provider)
        else:
            self._lingering[(kind, event.provider)] = time.monotonic() + _PUSH_BACK_LINGER

    def _settle_push_backs(self) -> None:
        """Close the lingering windows that a request met, or whose bound has passed."""
        now = time.monotonic()
        for ref, until in list(self._lingering_spikes.items()):
            if now >= until or self._spike_met(ref):
                del self._lingering_spikes[ref]
                self._end_latency(ref)
        for (kind, provider), until in list(self._lingering.items()):
            if now >= until or self._push_back_met(kind, provider):
                del self._lingering[(kind, provider)]
                self._close_push_back(kind, provider)

    def _push_back_met(self, kind: str, provider: str) -> bool:
        started = self._push_backs[(kind, provider)]
        fake = self._providers.by_name(provider)
        return (fake.throttled > started[0]) if kind == "throttle" \
            else (fake.outage_requests > started[1])

    def _close_push_back(self, kind: str, provider: str) -> None:
        started = self._push_backs.pop((kind, provider))
        fake = self._providers.by_name(provider)
        if kind == "throttle":
            fake.set_rate_limit(None)
            self.log.injected[kind] += fake.throttled - started[0]
        else:
            fake.set_outage(False)
            self.log.injected[kind] += fake.outage_requests - started[1]

    def _latency(self, event: FaultEvent) -> None:
        if any(provider == event.provider for provider, _ in self._spikes.values()):
            return  # a spike is already in force there
        fake = self._providers.by_name(event.provider)
        self._spikes[event.ref] = (event.provider, fake.total_requests)
        fake.set_latency(event.seconds)
        self.log.armed["latency"] += 1

    def _latency_ends(self, event: FaultEvent) -> None:
        """End the spike if a request met it; otherwise it stays (bounded) until one
        does, like a push-back window."""
        if event.ref not in self._spikes:
            return
        if self._spike_met(event.ref):
            self._end_latency(event.ref)
        else:
            self._lingering_spikes[event.ref] = time.monotonic() + _PUSH_BACK_LINGER

    def _spike_met(self, ref: int) -> bool:
        provider, requests = self._spikes[ref]
        return self._providers.by_name(provider).total_requests > requests

    def _end_latency(self, ref: int) -> None:
        spike = self._spikes.pop(ref, None)
        if spike is None:
            return
        fake = self._providers.by_name(spike[0])
        fake.set_latency(self._providers.latency)
        self.log.injected["latency"] += fake.total_requests - spike[1]
