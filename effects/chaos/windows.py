"""Aiming a kill at a failure window (a moment of a job's life where a crash must lose
nothing: during or after the claim, after the provider answered, during the record), and
telling afterwards what it hit.

Every dispatcher connection of a chaos worker is named ``outbox <role> <tag>`` and every
job it holds has ``claimed_by = <tag>``, so one worker's backends and jobs can be told
from the others'. The windows:

``during_claim``
    Once the worker has room to claim, the runner holds ``LOCK TABLE jobs IN SHARE
    MODE`` (at most ``LOCK_SECONDS``) until the worker's claim statement waits on it,
    kills the worker, then lets go: the claim was in flight, uncommitted, when the
    process died. (While the worker is full, a claim is only caught by chance.)
``during_done``
    The runner row-locks jobs whose provider call the worker finished (audit outcome
    ``ok``) until its completion statement (done + ledger) waits on them, kills, lets go.
``after_claim`` / ``after_provider``
    The runner waits until the worker holds a job it has not handed to the provider yet
    (no audit row for that claim version), or one the provider has performed but whose
    outcome is not recorded (job still ``running``), pauses it (SIGSTOP), looks again
    and kills the paused worker if it is still there (else lets it go on and waits
    again): the few milliseconds between a look and the kill can no longer carry the
    job out of its window.
``anytime``
    A plain kill at the scheduled moment.

A statement window is hit when the statement was seen executing before the kill and
still, same start, after it (it cannot end before the lock is released). The job windows
are judged from what the dead worker left behind once its backends are gone: held jobs
without an audit row (``after_claim``), with one but not performed by the provider
(``during_provider_call``), and performed but never recorded (``after_provider``).
Aiming is bounded by ``AIM_SECONDS`` (``JOB_AIM_SECONDS`` for the job windows); a kill
whose aim was not seen goes ahead anyway.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg

from ._sql import ChaosQueries
from .database import connect
from .pool import WorkerProcess
from .providers import Providers
from .settings import application_name

__all__ = [
    "AIM_SECONDS",
    "JOB_AIM_SECONDS",
    "JOB_WINDOWS",
    "LOCK_SECONDS",
    "WINDOWS",
    "Aimer",
    "Backend",
    "died_inside",
    "executing",
    "statement_windows",
]

AIM_SECONDS = 2.0
# A job window is met only while the worker claims (after_claim) or calls a provider that
# answers (after_provider); a worker full of slow calls meets neither for seconds.
JOB_AIM_SECONDS = 5.0
LOCK_SECONDS = 1.0
_VANISH_SECONDS = 3.0
JOB_WINDOWS = ("after_claim", "during_provider_call", "after_provider")
WINDOWS = ("during_claim", "after_claim", "during_provider_call", "after_provider",
           "during_done")
# role of the connection, and the starts of its statements as pg_stat_activity shows
# them: the claim of the effects free of limits (outbox/sql/claim.sql ``claim``) and
# that of the limited ones (``limit_claim``); the completion (``complete``).
_STATEMENTS = {"during_claim": ("claimer", ("WITH RECURSIVE clock AS",
                                            "WITH RECURSIVE budget AS")),
               "during_done": ("recorder", ("WITH finished",))}

# pid, application_name, state, query_start, wait_event_type, query
Backend = tuple[int, str, str | None, Any, str | None, str | None]


class Aimer:
    """Looks at one worker through the database, aims kills and judges their hits.

    ``queries`` read every target at once (the views); ``target_queries`` are bound to
    each target's own schema, for the locks (a worker of a fleet claims and completes
    in whichever target has its turn, so every target's jobs are locked). ``concurrency``
    is the most jobs a worker holds at once: a fleet's engines hold that many each.
    """

    def __init__(self, dsn: str, queries: ChaosQueries, providers: Providers,
                 concurrency: int, target_queries: Sequence[ChaosQueries]) -> None:
        self._dsn = dsn
        self._queries = queries
        self._target_queries = tuple(target_queries)
        self._providers = providers
        self._concurrency = concurrency
        self._conn: psycopg.Connection[Any] | None = None

    def close(self) -> None:
        """Close the observing connection."""
        if self._conn is not None:
            self._conn.close()
        self._conn = None

    def query(self, query: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        """Run one statement on the observing (autocommit) connection."""
        if self._conn is None or self._conn.closed:
            self._conn = connect(self._dsn, "chaos injector")
        try:
            return self._conn.execute(query, params).fetchall()
        except psycopg.OperationalError:
            self.close()
            raise

    def backends(self, worker: WorkerProcess) -> list[Backend]:
        """The worker's dispatcher backends as pg_stat_activity shows them now."""
        rows = self.query(self._queries.worker_backends,
                          {"names": worker.settings.application_names()})
        return [(r[0], r[1], r[2], r[3], r[4], r[5]) for r in rows]

    def held(self, worker: WorkerProcess) -> list[tuple[str, str, bool]]:
        """(key, effect, provider called under this claim) of the jobs it holds."""
        rows = self.query(self._queries.held_jobs, {"worker": worker.tag})
        return [(str(r[0]), str(r[1]), bool(r[3])) for r in rows]

    # -- aiming ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def aim(self, worker: WorkerProcess, window: str) -> Iterator[tuple[list[Backend], bool]]:
        """Wait until ``worker`` is in ``window`` (bounded); yield its backends and whether
        it got there. Kill inside the block: a lock the aim holds is let go after it."""
        if window == "during_claim":
            with self._claim_in_flight(worker) as aimed:
                yield aimed
        elif window == "during_done":
            with self._completion_in_flight(worker) as aimed:
                yield aimed
        else:
            yield self._wait_for_jobs(worker, window)

    def _wait_for_jobs(self, worker: WorkerProcess, window: str) -> tuple[list[Backend], bool]:
        if window == "anytime":
            return self.backends(worker), True
        deadline = time.monotonic() + JOB_AIM_SECONDS
        for _ in range(2000):  # bounded in count as well as in time
            if self._holds(worker, window) and self._paused_inside(worker, window):
                try:
                    return self.backends(worker), True
                except BaseException:  # no kill follows: the worker must not stay paused
                    worker.proc.send_signal(signal.SIGCONT)
                    raise
            if time.monotonic() > deadline:
                break
            time.sleep(0.005)
        return self.backends(worker), False

    def _paused_inside(self, worker: WorkerProcess, window: str) -> bool:
        """Pause ``worker`` and look again: whether it is still in ``window``, paused (the
        kill comes next). If it left meanwhile it goes on, as if never paused."""
        worker.proc.send_signal(signal.SIGSTOP)
        try:
            inside = self._holds(worker, window)
        except BaseException:
            worker.proc.send_signal(signal.SIGCONT)
            raise
        if not inside:
            worker.proc.send_signal(signal.SIGCONT)
        return inside

    def _holds(self, worker: WorkerProcess, window: str) -> bool:
        held = self.held(worker)
        if window == "after_claim":
            return any(not called for _, _, called in held)
        return any(called and self._performed(effect, key) for key, effect, called in held)

    @contextlib.contextmanager
    def _claim_in_flight(self, worker: WorkerProcess) -> Iterator[tuple[list[Backend], bool]]:
        """Catch the worker's claim statement in flight: by chance while the worker is
        full (it claims again once a quarter of its room is free), or, once it has room
        to claim, for sure, by locking the jobs table until its claim waits on the lock
        (a full worker would never claim under the lock: it could finish nothing)."""
        deadline = time.monotonic() + AIM_SECONDS
        backends: list[Backend] = []
        for _ in range(10_000):  # bounded in count as well as in time
            backends = self.backends(worker)
            if any(executing("during_claim", worker.tag, b) for b in backends):
                yield backends, True
                return
            if len(self.held(worker)) < self._concurrency:
                break
            if time.monotonic() > deadline:
                yield backends, False
                return
        with self._locker() as locker:
            if self._lock_table(locker):
                yield self._wait_for_statement(worker, "during_claim", LOCK_SECONDS)
                return
        yield backends, False

    def _lock_table(self, locker: psycopg.Connection[Any]) -> bool:
        try:
            locker.execute(self._queries.lock_timeout)
            for queries in self._target_queries:  # in one order: no deadlock among lockers
                locker.execute(queries.lock_jobs_table)
        except psycopg.errors.LockNotAvailable:
            return False  # writes in flight held it past lock_timeout: not this time
        return True

    @contextlib.contextmanager
    def _completion_in_flight(self, worker: WorkerProcess
                              ) -> Iterator[tuple[list[Backend], bool]]:
        """Row-lock jobs whose call ended well; wait for the completion to queue on them."""
        deadline = time.monotonic() + AIM_SECONDS
        for _ in range(1000):  # bounded in count as well as in time
            with self._locker() as locker:
                locker.execute(self._queries.lock_timeout)
                if [row for queries in self._target_queries
                        for row in locker.execute(queries.lock_recorded_jobs,
                                                  {"worker": worker.tag}).fetchall()]:
                    backends, seen = self._wait_for_statement(worker, "during_done", 0.5)
                    if seen or time.monotonic() > deadline:
                        yield backends, seen
                        return
            if time.monotonic() > deadline:
                break
            time.sleep(0.005)
        yield self.backends(worker), False

    def _wait_for_statement(self, worker: WorkerProcess, window: str,
                            seconds: float) -> tuple[list[Backend], bool]:
        deadline = time.monotonic() + seconds
        for _ in range(10_000):  # bounded in count as well as in time
            backends = self.backends(worker)
            if any(executing(window, worker.tag, b) for b in backends):
                return backends, True
            if time.monotonic() > deadline:
                return backends, False
            time.sleep(0.002)
        return self.backends(worker), False

    @contextlib.contextmanager
    def _locker(self) -> Iterator[psycopg.Connection[Any]]:
        """A connection in an open transaction, rolled back (locks let go) on exit."""
        with connect(self._dsn, "chaos locker") as conn:
            conn.autocommit = False
            try:
                yield conn
            finally:
                conn.rollback()

    # -- judging --------------------------------------------------------------------------

    def left_behind(self, worker: WorkerProcess) -> dict[str, int]:
        """The jobs the dead worker still holds, by window, once its backends are gone
        (so an in-flight statement has ended one way or the other)."""
        deadline = time.monotonic() + _VANISH_SECONDS
        while self.backends(worker) and time.monotonic() < deadline:
            time.sleep(0.01)
        counts = dict.fromkeys(JOB_WINDOWS, 0)
        for key, effect, called in self.held(worker):
            if not called:
                counts["after_claim"] += 1
            elif self._performed(effect, key):
                counts["after_provider"] += 1
            else:
                counts["during_provider_call"] += 1
        return counts

    def _performed(self, effect: str, key: str) -> bool:
        return self._providers.for_effect(effect).performed(key) > 0


def executing(window: str, tag: str, backend: Backend) -> bool:
    """Whether ``backend`` is the worker's connection running the ``window`` statement."""
    role, starts = _STATEMENTS[window]
    _, name, state, _, _, query = backend
    return (name == application_name(role, tag) and state == "active"
            and (query or "").lstrip().startswith(starts))


def died_inside(window: str, tag: str, before: list[Backend], after: list[Backend]) -> bool:
    """Whether a ``window`` statement ran before the kill and still ran, same start, after."""
    running = {(b[0], b[3]) for b in before if executing(window, tag, b)}
    return any((b[0], b[3]) in running for b in after if executing(window, tag, b))


def statement_windows() -> tuple[str, ...]:
    """The windows judged by statements in flight rather than by jobs held."""
    return tuple(_STATEMENTS)
