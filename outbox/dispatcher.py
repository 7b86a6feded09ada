"""The dispatcher: claim due jobs, perform their effects, record the outcome, fenced.

Three threads of its own and a pool of workers::

    claimer  (the caller's thread)  claim batches, rescue expired leases, retention
    recorder                        complete / settle batches, heartbeat held leases
    listener                        LISTEN for enqueue notifications, wake the claimer
    workers                         run ``perform`` (threads; async effects on one loop)

Each of claimer, recorder and listener has its own connection. Every statement is a
transaction of its own (autocommit), at READ COMMITTED set explicitly, so a claim commits
before any provider is called and no transaction is ever open across an effect. Every
write about a claimed job is fenced on ``claim_version``: a write that changes 0 rows
means the claim was lost, and is counted, never retried as if it had landed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import random
import signal
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime, timedelta
from queue import SimpleQueue
from types import FrameType
from typing import Any

import psycopg
from psycopg import sql
from pydantic import BaseModel, ValidationError

from . import _state
from ._enqueue import jsonb_problem, notify_channel
from ._sql import check_schema_name, queries
from ._state import Backoff, Decision
from .effect import Effect, Job, is_async_effect
from .errors import ConfigurationError, Permanent
from .migrate import require_current

__all__ = ["DispatchStats", "Dispatcher"]

log = logging.getLogger("outbox.dispatcher")

# Errors after which a statement is retried as a whole (the recorder keeps its batch).
# psycopg raises OperationalError both for a lost connection and for transient failures
# on a healthy one (40001 serialization, 40P01 deadlock, 55P03 lock timeout, 57014
# statement timeout): ``_Connection.lost`` tells them apart, and only a lost connection
# is replaced and counted as a reconnect.
_CONNECTION_ERRORS = (psycopg.OperationalError, psycopg.InterfaceError)


@dataclass
class DispatchStats:
    """Counters of one ``run`` or ``run_until_idle`` call.

    ``stale_completions`` counts fenced writes that changed 0 rows because the claim had
    been lost (lease expired and re-claimed); ``lost_claims`` counts claims a heartbeat
    found gone. Both are expected after a stall, and harmless: the later claim wins.
    ``rescued`` counts expired leases this dispatcher took back. ``claim_queries`` and
    ``claim_seconds`` give the claim latency (``claim_seconds / claim_queries`` on
    average, ``claim_seconds_max`` at worst).
    """

    claimed: int = 0
    done: int = 0
    retried: int = 0
    failed: int = 0
    reconcile: int = 0
    released: int = 0
    rescued: int = 0
    lost_claims: int = 0
    stale_completions: int = 0
    reconnects: int = 0
    purged: int = 0
    claim_queries: int = 0
    claim_seconds: float = 0.0
    claim_seconds_max: float = 0.0

    def as_dict(self) -> dict[str, int | float]:
        """The counters as a plain dict (for logs and JSON)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(eq=False)
class _Held:
    """A job this dispatcher has claimed and not yet recorded."""

    job: Job
    effect: Effect
    is_async: bool
    started: bool = False
    lost: bool = False


@dataclass
class _Success:
    result_json: str


@dataclass
class _Release:
    """Not started before shutdown: hand it back with the attempt refunded."""


_Outcome = _Success | BaseException | _Release


@dataclass
class _Timer:
    interval: float
    next_at: float = field(default=0.0)

    def due(self, now: float) -> bool:
        if now < self.next_at:
            return False
        self.next_at = now + self.interval
        return True


class _Connection:
    """One dispatcher connection: autocommit, READ COMMITTED, keepalives, reconnecting."""

    def __init__(self, dispatcher: Dispatcher, role: str) -> None:
        self._dispatcher = dispatcher
        self._role = role
        self._conn: psycopg.Connection[Any] | None = None
        self._failures = 0

    def get(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = self._dispatcher._connect(self._role)
        return self._conn

    @property
    def lost(self) -> bool:
        """Whether the connection is gone (after an error: lost, not a failed statement)."""
        return self._conn is None or self._conn.closed

    def execute(self, query: str, params: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        """Run one statement (its own transaction); discard the connection if it broke."""
        try:
            rows = self.get().execute(query, params).fetchall()
        except _CONNECTION_ERRORS:
            if self.lost:
                self.discard()
            raise
        self._failures = 0
        return rows

    def discard(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
        self._conn = None

    def backoff(self) -> float:
        """Seconds to wait before the next reconnection attempt (capped, jittered)."""
        self._failures += 1
        return random.uniform(0.05, min(5.0, 0.1 * 2**self._failures))


class Dispatcher:
    """Claims due jobs, performs their effects outside any transaction, records outcomes.

    Guarantees (with the database as the only source of truth):

    - A job is claimed in a short READ COMMITTED transaction with ``FOR UPDATE SKIP
      LOCKED``; two workers never hold the same job at the same ``claim_version``.
    - ``perform`` runs after the claim committed, outside any transaction, at most
      ``concurrency`` at a time. Delivery to an effect is at least once: a crash or a
      stall past the lease makes the job run again, with the same key.
    - Completion is one statement: the fenced ``running -> done`` update and the ledger
      row commit together or not at all. A stale worker's writes change nothing.
    - Leases are extended by heartbeats while effects run; a job whose worker died is
      rescued (fenced) once its lease expires, within one ``rescue_interval``.
    - Only jobs whose ``effect`` names one of ``effects`` are claimed; others stay pending.

    ``lease`` is the claim's lifetime in seconds (or a timedelta), at least 1 second.
    ``batch_size`` caps the jobs one claim takes. ``prefetch`` is how many claimed jobs
    may wait for a free worker (their leases are heartbeated too); by default it adapts
    to about one second of work at the measured speed of the effects (up to
    ``max_prefetch``), so fast effects are claimed in large batches while slow ones are
    not hoarded by one process. ``prefetch=0`` claims only what can start at once.
    """

    def __init__(
        self,
        conninfo: str,
        effects: Sequence[Effect],
        *,
        schema: str = "outbox",
        concurrency: int = 16,
        lease: float | timedelta = 30.0,
        batch_size: int | None = None,
        prefetch: int | None = None,
        max_prefetch: int = 4000,
        poll_interval: float | timedelta = 1.0,
        rescue_interval: float | timedelta | None = None,
        backoff: Backoff | None = None,
        unknown_outcome_window: float | timedelta = timedelta(hours=24),
        retention: float | timedelta | None = timedelta(days=7),
        ledger_retention: float | timedelta | None = timedelta(days=90),
        worker_id: str | None = None,
    ) -> None:
        self._conninfo = conninfo
        self.schema = check_schema_name(schema)
        self._effects = self._index_effects(effects)
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ConfigurationError(f"concurrency must be a positive integer, got {concurrency!r}")
        self.concurrency = concurrency
        self.lease = self._seconds(lease, "lease", minimum=1.0)
        self.batch_size = self._positive(
            max(concurrency, 500) if batch_size is None else batch_size, "batch_size"
        )
        self.prefetch = None if prefetch is None else self._positive(prefetch, "prefetch", 0)
        self.max_prefetch = self._positive(max_prefetch, "max_prefetch", 0)
        self._mean_perform_seconds: float | None = None
        self._retrying = False  # the recorder is re-sending a batch after an error
        self.poll_interval = self._seconds(poll_interval, "poll_interval", minimum=0.001)
        self.rescue_interval = self._seconds(
            rescue_interval if rescue_interval is not None else min(self.lease, 5.0),
            "rescue_interval", minimum=0.01,
        )
        if backoff is not None and not isinstance(backoff, Backoff):
            raise ConfigurationError(f"backoff must be an outbox.Backoff, got {backoff!r}")
        self.backoff = backoff or Backoff()
        self.unknown_outcome_window = self._seconds(
            unknown_outcome_window, "unknown_outcome_window", minimum=0.0
        )
        self.retention = None if retention is None else self._seconds(retention, "retention")
        self.ledger_retention = (
            None if ledger_retention is None
            else self._seconds(ledger_retention, "ledger_retention")
        )
        if (self.retention is not None and self.ledger_retention is not None
                and self.ledger_retention < self.retention):
            raise ConfigurationError("ledger_retention must not be shorter than retention")
        self.worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self._queries = queries(self.schema)
        self._effect_names = _text_array(sorted(self._effects))
        self._async_names = {n for n, e in self._effects.items() if is_async_effect(e)}
        self._has_async = bool(self._async_names)
        self._has_sync = len(self._async_names) < len(self._effects)
        self._rng = random.Random()
        self._held: dict[int, _Held] = {}
        self._outcomes: deque[tuple[_Held, _Outcome]] = deque()
        self._outcome_ready = threading.Event()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._releasing = False
        self._running = False
        self.stats = DispatchStats()

    # -- configuration -----------------------------------------------------------------

    @staticmethod
    def _seconds(value: float | timedelta, what: str, minimum: float = 0.0) -> float:
        try:
            return _state.seconds(value, what=what, minimum=minimum)
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(str(exc)) from None

    @staticmethod
    def _positive(value: int, what: str, minimum: int = 1) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigurationError(f"{what} must be an integer >= {minimum}, got {value!r}")
        return value

    @staticmethod
    def _index_effects(effects: Sequence[Effect]) -> dict[str, Effect]:
        if isinstance(effects, str | bytes | Effect) or not isinstance(effects, Iterable):
            raise ConfigurationError(
                f"effects must be a list of Effect objects, got {type(effects).__name__}"
            )
        indexed: dict[str, Effect] = {}
        for effect in effects:
            name = getattr(effect, "name", None)
            if not isinstance(name, str) or not name:
                raise ConfigurationError(f"{type(effect).__name__} has no effect name")
            if not callable(getattr(effect, "perform", None)):
                raise ConfigurationError(f"effect {name!r} has no perform() method")
            if name in indexed:
                raise ConfigurationError(f"two effects are named {name!r}")
            indexed[name] = effect
        if not indexed:
            raise ConfigurationError("a Dispatcher needs at least one effect")
        return indexed

    def _connect(self, role: str) -> psycopg.Connection[Any]:
        conn = psycopg.connect(
            self._conninfo,
            autocommit=True,
            connect_timeout=10,
            application_name=f"outbox {role} {self.worker_id}"[:63],
            keepalives=1, keepalives_idle=10, keepalives_interval=5, keepalives_count=3,
        )
        # Explicit, whatever the server default: under REPEATABLE READ or SERIALIZABLE,
        # SKIP LOCKED raises serialization failures instead of skipping. The timeout
        # releases a dead worker's open transaction (we never hold one on purpose).
        conn.execute("SET default_transaction_isolation = 'read committed'")
        conn.execute("SET idle_in_transaction_session_timeout = '60s'")
        # Abort a statement whose client has gone (PostgreSQL 14+), so a worker that dies
        # mid-claim leaves its claim rolled back instead of committed and orphaned.
        conn.execute("SET client_connection_check_interval = '1s'")
        return conn

    # -- public control ------------------------------------------------------------------

    def stop(self) -> None:
        """Ask ``run`` to stop: nothing new is claimed; in-flight work finishes or is
        released (jobs not started go back to ``pending`` with the attempt refunded).
        Safe to call from any thread or a signal handler."""
        self._releasing = True
        self._stopping.set()
        self._wake.set()

    def run_until_idle(self, timeout: float | None = None) -> DispatchStats:
        """Process every job that is due now, then return the counters of this call.

        Returns once no job of this dispatcher's effects is claimable and none is running,
        here or in another worker: a running job held elsewhere is waited for, and
        rescued and performed here if its lease expires (its worker died or froze). Jobs
        retried with a delay are not waited for. With ``timeout`` (seconds), stops
        claiming when it passes and returns once this dispatcher's in-flight work is
        recorded.
        """
        return self._serve(until_idle=True, timeout=timeout)

    def run(self) -> DispatchStats:
        """Dispatch until ``stop()``, SIGTERM or SIGINT; then finish in-flight work.

        Wakes on LISTEN/NOTIFY when jobs are enqueued and also polls with jitter.
        Survives connection loss and database restarts: reconnects with backoff.
        """
        with self._signals_stop():
            return self._serve(until_idle=False, timeout=None)

    @contextlib.contextmanager
    def _signals_stop(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum: int, frame: FrameType | None) -> None:
            log.info("signal %s: stopping after in-flight work", signum)
            self.stop()

        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)

    # -- the claimer loop -----------------------------------------------------------------

    def _serve(self, *, until_idle: bool, timeout: float | None) -> DispatchStats:
        if self._running:
            raise ConfigurationError("this Dispatcher is already running")
        self._running = True
        self.stats = DispatchStats()
        claimer = _Connection(self, "claimer")
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self._check_schema(claimer, deadline)
            with self._workers() as submit:
                recorder = threading.Thread(target=self._record_loop, name="outbox-recorder",
                                            daemon=True)
                listener = threading.Thread(target=self._listen_loop, name="outbox-listener",
                                            daemon=True)
                recorder.start()
                if not until_idle:
                    listener.start()
                try:
                    self._claim_loop(claimer, submit, until_idle, timeout)
                finally:
                    self._drain()
                    self._stopping.set()
                    self._outcome_ready.set()
                    recorder.join()
                    if listener.is_alive():
                        listener.join()
        finally:
            claimer.discard()
            # Reset here rather than on entry, so a stop() that comes before run() (or a
            # SIGTERM during start-up) is not forgotten.
            self._stopping.clear()
            self._releasing = False
            self._running = False
        return self.stats

    def _check_schema(self, claimer: _Connection, deadline: float | None) -> None:
        """Refuse a missing or newer schema at once; wait for an unreachable database
        (until ``deadline``, when there is one)."""
        while True:
            try:
                require_current(claimer.get(), self.schema)
                return
            except _CONNECTION_ERRORS as exc:
                claimer.discard()
                if deadline is not None and time.monotonic() >= deadline:
                    raise
                log.warning("cannot reach the database (%s); retrying", type(exc).__name__)
                if self._stopping.wait(claimer.backoff()):
                    return

    def _claim_loop(
        self, claimer: _Connection, submit: Callable[[list[_Held]], None], until_idle: bool,
        timeout: float | None,
    ) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        rescue = _Timer(self.rescue_interval)
        retention = _Timer(60.0)
        while not self._stopping.is_set():
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return
            try:
                if rescue.due(now):
                    self._rescue(claimer)
                if not until_idle and retention.due(now):
                    self._purge(claimer)
                claimed = self._claim(claimer, submit)
                if claimed:
                    continue
                if self._held:
                    self._wait(self.poll_interval)
                elif until_idle:
                    if not self._has_due_work(claimer):
                        return
                    self._rescue(claimer)
                    self._wait(0.05)
                else:
                    self._wait(self.poll_interval * self._rng.uniform(0.5, 1.0))
            except psycopg.Error as exc:
                self._claimer_failed(claimer, exc)

    def _claimer_failed(self, claimer: _Connection, exc: psycopg.Error) -> None:
        if claimer.lost:  # only a broken connection is replaced and counted
            self.stats.reconnects += 1
            log.warning("claimer lost its connection (%s); reconnecting", type(exc).__name__)
        else:  # a failed statement, transient (40001, 40P01, 55P03, 57014) or not
            log.error("claimer query failed: %s", exc.sqlstate or type(exc).__name__)
        self._wait(claimer.backoff())

    def _wait(self, seconds: float) -> None:
        self._wake.wait(seconds)
        self._wake.clear()

    def _room(self) -> int:
        capacity = self._capacity()
        room = capacity - len(self._held)
        # Claim in batches: wait until a good part of a batch is free rather than
        # spending a round trip per finished job, unless nothing at all is held.
        if self._held and room < max(1, min(self.batch_size, capacity // 4)):
            return 0
        return min(room, self.batch_size)

    def _capacity(self) -> int:
        """Jobs to hold at once: one per worker, plus claimed ones waiting for a worker,
        so workers never idle while the next claim is in flight."""
        if self.prefetch is not None:
            return self.concurrency + self.prefetch
        mean = self._mean_perform_seconds
        if mean is None:  # nothing measured yet: be modest
            return 2 * self.concurrency
        one_second_of_work = self.concurrency / max(mean, 1e-6)
        return self.concurrency + int(min(self.max_prefetch, max(1.0, one_second_of_work)))

    def _measured(self, started: float) -> None:
        # An exponential moving average; a lost update between threads is harmless.
        elapsed = time.monotonic() - started
        mean = self._mean_perform_seconds
        self._mean_perform_seconds = elapsed if mean is None else 0.9 * mean + 0.1 * elapsed

    def _claim(self, claimer: _Connection, submit: Callable[[list[_Held]], None]) -> int:
        limit = self._room()
        if limit <= 0:
            return 0
        started = time.monotonic()
        rows = claimer.execute(self._queries.claim, {
            "effects": self._effect_names, "limit": limit, "lease": self.lease,
            "worker": self.worker_id,
        })
        elapsed = time.monotonic() - started
        self.stats.claim_queries += 1
        self.stats.claim_seconds += elapsed
        self.stats.claim_seconds_max = max(self.stats.claim_seconds_max, elapsed)
        batch: list[_Held] = []
        for row in rows:
            job = Job(id=row[0], effect=row[1], key=row[2], payload=row[3], attempt=row[4],
                      claim_version=row[5], ordering_key=row[6], max_attempts=row[7],
                      first_attempted_at=row[8])
            held = _Held(job, self._effects[job.effect], job.effect in self._async_names)
            self._held[job.id] = held
            batch.append(held)
        submit(batch)
        self.stats.claimed += len(rows)
        return len(rows)

    def _has_due_work(self, claimer: _Connection) -> bool:
        rows = claimer.execute(self._queries.has_due_work, {"effects": self._effect_names})
        return bool(rows[0][0])

    def _rescue(self, claimer: _Connection) -> None:
        rows = claimer.execute(self._queries.rescue, {
            "limit": 1000, "unknown_window": self.unknown_outcome_window,
        })
        for job_id, key, status, version in rows:
            log.warning("rescued job %s (key %s, version %s) after its lease expired: now %s",
                        job_id, key, version, status)
        self.stats.rescued += len(rows)

    def _purge(self, claimer: _Connection) -> None:
        for query, age in ((self._queries.purge_done, self.retention),
                           (self._queries.purge_ledger, self.ledger_retention)):
            if age is None:
                continue
            for _ in range(10):  # bounded per round: retention must not starve claims
                conn = claimer.get()
                deleted = conn.execute(query, {"age": age, "limit": 1000}).rowcount
                self.stats.purged += max(deleted, 0)
                if deleted < 1000:
                    break

    def _drain(self) -> None:
        """Stop claiming; release queued jobs; wait until every held job is recorded."""
        self._releasing = True
        while self._held:
            self._outcome_ready.set()
            self._wait(0.05)

    # -- workers ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _workers(self) -> Iterator[Callable[[list[_Held]], None]]:
        """Start the workers; yield a function that hands them a batch of claimed jobs.

        Sync effects run on ``concurrency`` threads fed by one C-implemented queue (no
        per-job futures); async effects run as tasks on one event loop, at most
        ``concurrency`` at a time.
        """
        queue: SimpleQueue[list[_Held] | None] = SimpleQueue()
        threads = [
            threading.Thread(target=self._work, args=(queue,), name=f"outbox-worker-{n}",
                             daemon=True)
            for n in range(self.concurrency if self._has_sync else 0)
        ]
        for thread in threads:
            thread.start()
        runner = _AsyncRunner(self, self.concurrency) if self._has_async else None

        def submit(batch: list[_Held]) -> None:
            sync = batch if runner is None else [h for h in batch if not h.is_async]
            for chunk in self._chunks(sync):
                queue.put(chunk)
            if runner is not None and len(sync) < len(batch):
                runner.submit([h for h in batch if h.is_async])

        try:
            yield submit
        finally:
            for _ in threads:
                queue.put(None)
            for thread in threads:
                thread.join()
            if runner is not None:
                runner.close()

    def _work(self, queue: SimpleQueue[list[_Held] | None]) -> None:
        while (chunk := queue.get()) is not None:
            for held in chunk:
                self._perform_sync(held)
            self._outcome_ready.set()  # once per chunk: the recorder takes them all

    def _chunks(self, batch: list[_Held]) -> list[list[_Held]]:
        """Split a claimed batch into the units workers take from the queue.

        Slow effects go one job per unit, so every worker stays busy. Effects measured to
        take under a millisecond go in runs spread over the workers: handing over each
        job separately would cost more in thread wake-ups than the jobs themselves.
        """
        mean = self._mean_perform_seconds
        if mean is None or mean >= 0.001 or len(batch) <= self.concurrency:
            return [[held] for held in batch]
        size = min(64, -(-len(batch) // self.concurrency))
        return [batch[i:i + size] for i in range(0, len(batch), size)]

    def _begin(self, held: _Held) -> bool:
        """Mark ``held`` as started, or hand it back if it must not start."""
        if held.lost:
            self._held.pop(held.job.id, None)
            self._wake.set()
            return False
        if self._releasing:
            self._finish(held, _Release())
            return False
        held.started = True
        return True

    def _prepare_job(self, held: _Held) -> Job:
        model_type = getattr(held.effect, "payload_model", None)
        if model_type is None:
            return held.job
        try:
            model = model_type.model_validate(held.job.payload)
        except ValidationError as exc:
            raise Permanent(_describe_validation(held.job.effect, exc)) from None
        return dataclasses.replace(held.job, model=model)

    def _perform_sync(self, held: _Held) -> None:
        if not self._begin(held):
            return
        started = time.monotonic()
        try:
            result = held.effect.perform(self._prepare_job(held))
            outcome: _Outcome = _Success(_result_json(held.job, result))
        except BaseException as exc:
            # Every failure is an outcome to record, even SystemExit raised by an effect:
            # the job must not vanish with its thread.
            outcome = exc
        self._measured(started)
        self._outcomes.append((held, outcome))  # the worker signals once per chunk

    async def _perform_async(self, held: _Held) -> None:
        if not self._begin(held):
            return
        started = time.monotonic()
        try:
            result = await held.effect.perform(self._prepare_job(held))  # type: ignore[misc]
            outcome: _Outcome = _Success(_result_json(held.job, result))
        except BaseException as exc:  # CancelledError included: recorded as a retry
            outcome = exc
        self._measured(started)
        self._finish(held, outcome)

    def _finish(self, held: _Held, outcome: _Outcome) -> None:
        self._outcomes.append((held, outcome))
        self._outcome_ready.set()

    # -- the recorder ----------------------------------------------------------------------

    def _record_loop(self) -> None:
        conn = _Connection(self, "recorder")
        heartbeat = _Timer(_state.heartbeat_interval(self.lease))
        heartbeat.next_at = time.monotonic() + heartbeat.interval
        pending: list[tuple[_Held, _Outcome]] = []
        try:
            while True:
                finished = self._stopping.is_set() and not self._held and not self._outcomes
                if finished and not pending:
                    return
                self._outcome_ready.wait(min(heartbeat.interval, 0.5))
                self._outcome_ready.clear()
                while self._outcomes:
                    pending.append(self._outcomes.popleft())
                try:
                    if pending:
                        self._flush(conn, pending)
                    self._retrying = False
                    if heartbeat.due(time.monotonic()):
                        self._heartbeat(conn)
                except _CONNECTION_ERRORS as exc:
                    self._retrying = bool(pending)
                    if conn.lost:
                        self.stats.reconnects += 1
                        log.warning("recorder lost its connection (%s); reconnecting",
                                    type(exc).__name__)
                    else:  # transient (40001, 40P01, 55P03, 57014): retry the same batch
                        log.error("recorder statement failed: %s; retrying",
                                  exc.sqlstate or type(exc).__name__)
                    time.sleep(conn.backoff())
                except Exception as exc:  # a heartbeat failed otherwise: next round
                    log.error("heartbeat failed: %s",
                              getattr(exc, "sqlstate", None) or type(exc).__name__)
                    time.sleep(conn.backoff())
        finally:
            conn.discard()

    def _record(self, conn: _Connection, batch: list[tuple[_Held, _Outcome]]) -> None:
        """Write one batch of outcomes: at most two statements, each fenced.

        What was written is removed from ``batch``, so after a connection loss the caller
        retries only the rest.
        """
        successes = [(h, o) for h, o in batch if isinstance(o, _Success)]
        if successes:
            claims = ",".join(
                f'{{"id":{h.job.id},"version":{h.job.claim_version},"result":{o.result_json}}}'
                for h, o in successes
            )
            written = {r[0] for r in conn.execute(self._queries.complete,
                                                  {"claims": f"[{claims}]"})}
            if self._retrying and len(written) < len(successes):
                written |= self._landed_before(conn, [h for h, _ in successes
                                                      if h.job.id not in written])
            self._account([h for h, _ in successes], written, "done")
            batch[:] = [(h, o) for h, o in batch if not isinstance(o, _Success)]
        if not batch:
            return
        settles = [(h, isinstance(o, _Release), self._settlement(h, o)) for h, o in batch]
        rows = conn.execute(self._queries.settle, {"claims": json.dumps([
            {"id": h.job.id, "version": h.job.claim_version, "status": d.status,
             "delay": d.delay, "error": d.error, "refund": released}
            for h, released, d in settles
        ])})
        written = {r[0] for r in rows}
        for held, released, decision in settles:
            self._account([held], written, "released" if released else decision.status)
        batch.clear()

    def _flush(self, conn: _Connection, pending: list[tuple[_Held, _Outcome]]) -> None:
        try:
            self._record(conn, pending)
        except _CONNECTION_ERRORS:
            raise
        except Exception as exc:  # a row the database refused, or a bug of ours
            log.error("recording a batch failed (%s); recording one by one",
                      getattr(exc, "sqlstate", None) or type(exc).__name__)
            self._record_singly(conn, pending)

    def _landed_before(self, conn: _Connection, helds: list[_Held]) -> set[int]:
        """Ids among ``helds`` whose completion by this very claim already committed: a
        retried batch whose first attempt landed but whose reply was lost."""
        claims = ",".join(f'{{"id":{h.job.id},"version":{h.job.claim_version}}}' for h in helds)
        return {r[0] for r in conn.execute(self._queries.recorded_claims,
                                           {"claims": f"[{claims}]"})}

    def _record_singly(self, conn: _Connection, batch: list[tuple[_Held, _Outcome]]) -> None:
        """Fallback after a batch failed for a reason other than the connection: record
        each outcome alone so one bad row cannot block the rest. An outcome that still
        cannot be written is dropped here; its lease expires and the rescuer retries it,
        so it counts an attempt and ends ``failed`` rather than looping forever."""
        for item in list(batch):
            try:
                self._record(conn, [item])
            except _CONNECTION_ERRORS:
                raise
            except Exception as exc:
                held = item[0]
                self._held.pop(held.job.id, None)
                log.error("job %s (key %s): outcome could not be recorded (%s); the lease "
                          "will expire and the job be retried", held.job.id, held.job.key,
                          getattr(exc, "sqlstate", None) or type(exc).__name__)
            batch.remove(item)

    def _settlement(self, held: _Held, outcome: _Outcome) -> Decision:
        if isinstance(outcome, _Release):
            return Decision("pending", delay=0.0, error=None)
        assert isinstance(outcome, BaseException)
        decision = _state.decide(
            outcome, attempt=held.job.attempt, max_attempts=held.job.max_attempts,
            first_attempted_at=held.job.first_attempted_at, now=datetime.now(UTC),
            unknown_outcome_window=self.unknown_outcome_window, backoff=self.backoff,
            rng=self._rng,
        )
        log.log(
            logging.WARNING if decision.status != "pending" else logging.INFO,
            "job %s (key %s) attempt %s: %s -> %s",
            held.job.id, held.job.key, held.job.attempt, type(outcome).__name__, decision.status,
        )
        return decision

    def _account(self, helds: list[_Held], written: set[int], outcome: str) -> None:
        counter = {"done": "done", "pending": "retried", "failed": "failed",
                   "reconcile": "reconcile", "released": "released"}[outcome]
        for held in helds:
            self._held.pop(held.job.id, None)
            if held.job.id in written:
                setattr(self.stats, counter, getattr(self.stats, counter) + 1)
            else:
                self.stats.stale_completions += 1
                log.warning("job %s (key %s): claim version %s was lost before its outcome "
                            "was recorded; the newer claim decides", held.job.id, held.job.key,
                            held.job.claim_version)
        self._wake.set()

    def _heartbeat(self, conn: _Connection) -> None:
        held = [h for h in list(self._held.values()) if not h.lost]
        if not held:
            return
        claims = ",".join(f'{{"id":{h.job.id},"version":{h.job.claim_version}}}' for h in held)
        rows = conn.execute(self._queries.heartbeat, {"claims": f"[{claims}]",
                                                      "lease": self.lease})
        alive = {r[0] for r in rows}
        for h in held:
            if h.job.id not in alive and h.job.id in self._held:
                h.lost = True
                self.stats.lost_claims += 1
                log.warning("job %s (key %s): heartbeat found claim version %s lost",
                            h.job.id, h.job.key, h.job.claim_version)

    # -- the listener ----------------------------------------------------------------------

    def _listen_loop(self) -> None:
        """Turn enqueue notifications into wake-ups. Only a hint: the claimer polls too."""
        channel = notify_channel(self.schema)
        conn = _Connection(self, "listener")
        while not self._stopping.is_set():
            try:
                listening = conn.get()
                listening.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
                self._wake.set()  # jobs may have arrived while we were not listening
                while not self._stopping.is_set():
                    for _ in listening.notifies(timeout=0.25):
                        self._wake.set()
            except _CONNECTION_ERRORS:
                conn.discard()
                self._stopping.wait(conn.backoff())
        conn.discard()


class _AsyncRunner:
    """An event loop on its own thread running async effects, ``limit`` at a time."""

    def __init__(self, dispatcher: Dispatcher, limit: int) -> None:
        self._dispatcher = dispatcher
        self._loop = asyncio.new_event_loop()
        self._limit = limit
        self._tasks: set[asyncio.Task[None]] = set()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="outbox-async",
                                        daemon=True)
        self._thread.start()
        ready.wait()

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._semaphore = asyncio.Semaphore(self._limit)
        self._loop.call_soon(ready.set)
        self._loop.run_forever()

    def submit(self, batch: list[_Held]) -> None:
        """Schedule a batch from any thread: one wake-up of the loop per batch."""
        self._loop.call_soon_threadsafe(self._spawn, batch)

    def _spawn(self, batch: list[_Held]) -> None:
        for held in batch:
            task = self._loop.create_task(self._limited(held))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _limited(self, held: _Held) -> None:
        async with self._semaphore:
            await self._dispatcher._perform_async(held)

    def close(self) -> None:
        """Stop the loop once every task has finished."""

        async def finish() -> None:
            while self._tasks:
                await asyncio.gather(*list(self._tasks), return_exceptions=True)
            self._loop.stop()

        asyncio.run_coroutine_threadsafe(finish(), self._loop)
        self._thread.join()
        self._loop.close()


def _text_array(values: list[str]) -> str:
    """A PostgreSQL text[] literal, built once: cheaper than adapting a list per query."""
    quoted = ('"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values)
    return "{" + ",".join(quoted) + "}"


def _result_json(job: Job, result: object) -> str:
    if result is None:
        return "null"
    try:
        if isinstance(result, BaseModel):
            text = result.model_dump_json()
        else:
            text = json.dumps(result, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
        problem = jsonb_problem(text)
        if problem:
            raise ValueError(problem)
        return text
    except (TypeError, ValueError) as exc:
        # The effect has happened; refusing to record it would make it happen again.
        log.error("job %s (key %s): result is not JSON (%s); recorded without it",
                  job.id, job.key, type(exc).__name__)
        return json.dumps({"unrecorded_result": type(result).__name__})


def _describe_validation(effect: str, error: ValidationError) -> str:
    problems = []
    for item in error.errors(include_input=False, include_url=False):
        where = ".".join(str(part) for part in item["loc"]) or "(payload)"
        problems.append(f"{where}: {item['msg']}")
    return f"payload invalid for effect {effect!r}: " + "; ".join(problems)
