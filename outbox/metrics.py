"""Prometheus metrics (``outbox-pg[prometheus]``): the queue as the database sees it, and
each dispatcher's own activity.

Two sources, never mixed:

- ``DatabaseCollector``: gauges read from the tables at scrape time, by one collector
  (the dashboard's ``GET /metrics``, or any process with ``outbox-pg[prometheus]``), not by
  every worker: ``outbox_jobs{status,effect}`` (exact for a status with at most 10,000
  jobs, estimated from a block sample beyond: no scrape reads the whole backlog),
  ``outbox_oldest_due_job_age_seconds{effect}`` (due as the claim decides it),
  ``outbox_expired_leases{effect}``, ``outbox_oldest_reconcile_job_age_seconds{effect}``,
  ``outbox_jobs_dead_tuples``, ``outbox_unhandled_due_jobs{effect}``,
  ``outbox_database_up``. It needs
  prometheus-client only (not the dashboard's extra).
- ``PrometheusObserver``: a ``DispatchObserver`` counting one dispatcher process's
  attempts, durations, queue waits, claims, fence rejections and rescues.

Labels carry only bounded values: the status, the outcome and the effect name (an effect
registered with the dispatcher; the collector folds effects past ``MAX_EFFECTS`` into
``other``). Never ids, keys, worker names or error text.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from typing import Any

try:  # outbox-pg[prometheus]
    from prometheus_client import CollectorRegistry
except ModuleNotFoundError as exc:
    from ._extras import missing_extra

    raise missing_extra(exc, "outbox.metrics", "prometheus") from exc
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import REGISTRY, Collector

from ._database_metrics import MAX_EFFECTS, DatabaseCollector, render_database_metrics
from .observe import AttemptOutcome, DispatchObserver, MultiObserver

__all__ = [
    "MAX_EFFECTS",
    "DatabaseCollector",
    "PrometheusObserver",
    "render_database_metrics",
    "serve_metrics",
    "with_metrics",
]

_ATTEMPT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 30.0, 60.0)
_QUEUE_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 15, 60, 300, 900, 3600, 14400)
_CLAIM_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5)
OUTCOMES: tuple[AttemptOutcome, ...] = ("done", "retry", "failed", "reconcile", "released",
                                        "lost")


class _Histogram:
    """Bucket counts (not cumulative) and a sum; the owner holds the lock."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def buckets(self) -> list[tuple[str, float]]:
        cumulative, out = 0, list[tuple[str, float]]()
        for bound, count in zip((*map(_le, self.bounds), "+Inf"), self.counts, strict=True):
            cumulative += count
            out.append((bound, cumulative))
        return out


def _le(bound: float) -> str:
    return repr(float(bound))


class PrometheusObserver(DispatchObserver, Collector):
    """One dispatcher process's metrics, as a ``DispatchObserver``.

    ``outbox_job_attempts_total{effect,outcome}``,
    ``outbox_job_attempt_duration_seconds{effect,outcome}``,
    ``outbox_job_queue_wait_seconds{effect}``, ``outbox_claim_duration_seconds``,
    ``outbox_fence_rejections_total{effect}``, ``outbox_lease_rescues_total``,
    ``outbox_jobs_in_flight{effect}`` and ``outbox_last_claim_timestamp_seconds`` (the
    last claim that returned jobs). Use one per registry: ``PrometheusObserver.default()``
    is the shared instance on prometheus-client's default registry.

    Thread-safe and cheap: an event takes one lock and updates plain counters; the
    metric families are built only when the registry is scraped. (prometheus-client's
    own metric objects lock per sample, which cost the no-op drain 15 %; these events
    take about 0.7 us per job.)
    """

    _default: PrometheusObserver | None = None
    _default_lock = threading.Lock()

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self._lock = threading.Lock()
        self._durations: dict[tuple[str, str], _Histogram] = {}
        self._waits: dict[str, _Histogram] = {}
        self._claims = _Histogram(_CLAIM_BUCKETS)
        self._fences: dict[str, int] = {}
        self._rescues = 0
        # Jobs in flight = started - ended (per effect), derived at scrape.
        self._started: dict[str, int] = {}
        self._ended: dict[str, int] = {}
        self._last_claim: float | None = None
        # Targets of a dispatcher serving several (target name -> up): one series each,
        # as many as the targets configured.
        self._targets: dict[str, bool] = {}
        (REGISTRY if registry is None else registry).register(self)

    @classmethod
    def default(cls) -> PrometheusObserver:
        """The process-wide observer on the default registry (created once)."""
        with cls._default_lock:
            if cls._default is None:
                cls._default = cls()
            return cls._default

    # -- events (dispatcher threads) ---------------------------------------------------

    def effects_registered(self, effects: Sequence[str]) -> None:
        """Start every labelled series of these effects at 0: attempts and durations per
        outcome, queue waits, fence rejections, jobs in flight."""
        with self._lock:
            for effect in effects:
                for outcome in OUTCOMES:
                    self._durations.setdefault((effect, outcome), _Histogram(_ATTEMPT_BUCKETS))
                self._waits.setdefault(effect, _Histogram(_QUEUE_WAIT_BUCKETS))
                self._fences.setdefault(effect, 0)
                self._started.setdefault(effect, 0)

    def claimed(self, duration: float, waits: Sequence[tuple[str, float]]) -> None:
        """Claim latency, each claimed job's queue wait, and the last claim time."""
        now = time.time() if waits else None
        with self._lock:
            self._claims.observe(duration)
            if now is not None:
                self._last_claim = now
            histograms = self._waits
            for effect, waited in waits:
                histogram = histograms.get(effect)
                if histogram is None:
                    histogram = histograms[effect] = _Histogram(_QUEUE_WAIT_BUCKETS)
                # Inlined _Histogram.observe: this loop runs once per claimed job.
                seconds = waited if waited > 0 else 0.0  # clock skew: never negative
                histogram.counts[bisect_left(_QUEUE_WAIT_BUCKETS, seconds)] += 1
                histogram.total += seconds

    def attempt_started(self, effect: str) -> None:
        """One more job in flight."""
        with self._lock:
            self._started[effect] = self._started.get(effect, 0) + 1

    def attempt_finished(self, effect: str, outcome: AttemptOutcome, duration: float) -> None:
        """Count the attempt and its duration (jobs in flight are derived at scrape)."""
        key = (effect, outcome)
        with self._lock:
            histogram = self._durations.get(key)
            if histogram is None:
                histogram = self._durations[key] = _Histogram(_ATTEMPT_BUCKETS)
            histogram.counts[bisect_left(_ATTEMPT_BUCKETS, duration)] += 1
            histogram.total += duration
            # A job released at shutdown, or found lost before it began, never started:
            # per the observer contract its duration is 0 and it was never counted in.
            if duration > 0 or outcome not in ("released", "lost"):
                self._ended[effect] = self._ended.get(effect, 0) + 1

    def fence_rejected(self, effect: str) -> None:
        """A fenced write changed 0 rows."""
        with self._lock:
            self._fences[effect] = self._fences.get(effect, 0) + 1

    def rescued(self, count: int) -> None:
        """Leases taken back by this dispatcher's rescuer."""
        with self._lock:
            self._rescues += count

    def target_state(self, target: str, up: bool) -> None:
        """Whether a target of a dispatcher serving several is up."""
        with self._lock:
            self._targets[target] = up

    # -- scrape ------------------------------------------------------------------------

    def collect(self) -> Iterator[Metric]:
        """The metric families, from a consistent copy of the counters."""
        with self._lock:
            attempts = {k: sum(h.counts) for k, h in self._durations.items()}
            durations = {k: (h.buckets(), h.total) for k, h in self._durations.items()}
            waits = {k: (h.buckets(), h.total) for k, h in self._waits.items()}
            claim_buckets, claim_seconds = self._claims.buckets(), self._claims.total
            fences, rescues = dict(self._fences), self._rescues
            in_flight = {e: n - self._ended.get(e, 0) for e, n in self._started.items()}
            last_claim = self._last_claim
            targets = dict(self._targets)
        family: Any = CounterMetricFamily(
            "outbox_job_attempts", "Attempts by how they ended.", labels=["effect", "outcome"])
        for labels, n in sorted(attempts.items()):
            family.add_metric(list(labels), n)
        yield family
        family = HistogramMetricFamily(
            "outbox_job_attempt_duration_seconds", "Seconds perform() ran, by outcome.",
            labels=["effect", "outcome"])
        for labels, (buckets, total) in sorted(durations.items()):
            family.add_metric(list(labels), buckets, total)
        yield family
        family = HistogramMetricFamily(
            "outbox_job_queue_wait_seconds", "Seconds a job was due before it was claimed.",
            labels=["effect"])
        for effect, (buckets, total) in sorted(waits.items()):
            family.add_metric([effect], buckets, total)
        yield family
        yield HistogramMetricFamily("outbox_claim_duration_seconds",
                                    "Seconds one claim statement took.",
                                    buckets=claim_buckets, sum_value=claim_seconds)
        family = CounterMetricFamily(
            "outbox_fence_rejections", "Fenced writes that changed 0 rows (claim lost).",
            labels=["effect"])
        for effect, n in sorted(fences.items()):
            family.add_metric([effect], n)
        yield family
        yield CounterMetricFamily("outbox_lease_rescues", "Expired leases taken back.",
                                  value=rescues)
        family = GaugeMetricFamily("outbox_jobs_in_flight", "Jobs whose perform() is running.",
                                   labels=["effect"])
        for effect, n in sorted(in_flight.items()):
            family.add_metric([effect], n)
        yield family
        if targets:
            family = GaugeMetricFamily(
                "outbox_target_up", "1 while a target of this dispatcher is reachable and "
                "served; 0 while it fails (refused, no schema or privilege, migrating).",
                labels=["target"])
            for target, up in sorted(targets.items()):
                family.add_metric([target], 1 if up else 0)
            yield family
        if last_claim is not None:
            yield GaugeMetricFamily("outbox_last_claim_timestamp_seconds",
                                    "Unix time of the last claim that returned jobs.",
                                    value=last_claim)


def with_metrics(observer: DispatchObserver) -> DispatchObserver:
    """``observer`` plus the process's default PrometheusObserver (added once)."""
    metrics = PrometheusObserver.default()
    if observer is metrics or (isinstance(observer, MultiObserver)
                               and metrics in observer.observers):
        return observer
    if type(observer) is DispatchObserver:  # the do-nothing default
        return metrics
    return MultiObserver([observer, metrics])


def serve_metrics(port: int, host: str = "127.0.0.1",
                  registry: CollectorRegistry | None = None) -> Any:
    """Serve ``registry`` (default: the default one) on ``host:port`` from a daemon
    thread; loopback unless told otherwise (prometheus-client alone would bind every
    interface). Returns the server: ``shutdown()`` stops it."""
    from prometheus_client import start_http_server

    server, _thread = start_http_server(port, addr=host,
                                        registry=REGISTRY if registry is None else registry)
    return server
