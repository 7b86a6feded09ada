"""The recorder: writes outcomes in fenced batches and heartbeats the leases held.

Written once as steps (``outbox._steps``) and a loop (``recording``, a program of
``runtime``), driven on the recorder thread of ``Dispatcher`` and as a task of
``AsyncDispatcher`` (``serving``). A batch is at most two statements: ``complete``
(the fenced ``running -> done`` update and the ledger row, together) and ``settle``
(retry, release, failed, reconcile). A fenced write that changes 0 rows means the claim
was lost: counted, reported, never retried as if it had landed. What is reported of a
settled job (its count, the observer's events, its span) is the decision ``settle``
wrote: the one for a claim an operator cancelled meanwhile, when it found it so.
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from datetime import UTC, datetime
from typing import Any, cast

import psycopg

from .. import _lifecycle
from .._cancelling import signal_of
from .._lifecycle import Decision
from .._pg import configuration_error
from .._steps import Statement, Step
from ..errors import ConfigurationError, Throttled
from ..observe import AttemptOutcome
from .budget import report
from .cancellation import told_to_stop
from .connection import CONNECTION_ERRORS, AsyncConnection, Connection
from .hooked import HookedOutcomes, close_quietly, flush_hooked
from .reconciler import reconcilers
from .runtime import Call, Program, Run, Sleep, Wait
from .settings import Settings
from .settling import (
    as_written,
    completion_claims,
    fenced_claims,
    recorded_claims,
    reported,
    settle_claim,
    settle_claims,
)
from .shared import home_budget
from .standby import ReadOnlyServer
from .state import (
    Held,
    Outcome,
    Release,
    SharedState,
    Success,
    Timer,
    guarded,
)

__all__ = ["Recorder", "recording"]

log = logging.getLogger("outbox.dispatcher")


class Recorder:
    """The recorder's logic. Runs on one thread (or task) only."""

    def __init__(self, settings: Settings, state: SharedState[Any]) -> None:
        self.settings = settings
        self.state = state
        self.queries = settings.queries
        # retention 0 keeps no done rows: completion deletes the job (same fence, same
        # ledger row), sparing the index entries of an update and a purge later.
        self.complete = (self.queries.complete_delete if settings.retention == 0
                         else self.queries.complete)
        # Written by the recorder only: it is re-sending a batch after an error, so a
        # completion missing from the reply may have landed the first time.
        self.retrying = False
        self.rng = random.Random()  # the backoff's jitter
        # Outcomes whose effect has a completion hook take the per-job path (hooks);
        # None keeps the batched path alone, untouched, when no effect has one.
        self.hooked = (HookedOutcomes(self) if settings.done_hooks or settings.failed_hooks
                      else None)
        # Effects whose unknown outcomes the reconciler can settle (Effect.reconcile).
        self.reconciling = frozenset(reconcilers(settings))

    # -- outcomes ---------------------------------------------------------------------

    def flush(self, pending: list[tuple[Held, Outcome]]) -> Step[None]:
        """Record ``pending``; on a refused batch (not a lost connection), one by one.

        What was written is removed from ``pending``, so after a connection error the
        caller retries only the rest (with ``retrying`` set). Any other error ends the
        recorder (a missing privilege, or a bug of ours): what is left in ``pending`` is
        dropped first, so every attempt still reaches the observer. Outcomes with a
        completion hook are moved to ``hooked``, written by the caller with
        ``flush_hooked``.
        """
        if not self.retrying:  # what the batch says about its providers, once
            yield from report(self.settings, self.state.limits, pending)
        # Settlements the hooks decided while sorting the outcomes out, by job id.
        decided = self.hooked.take(pending, self.settlement) if self.hooked is not None else {}
        try:
            yield from self._flush(pending, decided)
        except (*CONNECTION_ERRORS, GeneratorExit):
            raise
        except BaseException as exc:
            for held, _ in pending:
                self.state.drop(held, exc)
            pending.clear()
            raise

    def _flush(self, pending: list[tuple[Held, Outcome]],
               decided: dict[int, Decision]) -> Step[None]:
        try:
            yield from self.record(pending, decided)
        except CONNECTION_ERRORS:
            raise
        except psycopg.Error as exc:  # a row the database refused
            if (fatal := configuration_error(exc, doing="record outcomes")) is not None:
                raise fatal from exc  # a missing privilege refuses every row alike
            log.error("recording a batch failed (%s); recording one by one",
                      getattr(exc, "sqlstate", None) or type(exc).__name__)
            yield from self.record_singly(pending, decided)

    def record(self, batch: list[tuple[Held, Outcome]],
               decided: dict[int, Decision] | None = None) -> Step[None]:
        """Write one batch of outcomes: at most two statements, each fenced. ``decided``:
        settlements already taken (by job id), not settled again."""
        # The pairs themselves, not copies: a tuple a job less for the collector.
        successes = cast(list[tuple[Held, Success]],
                         [pair for pair in batch if isinstance(pair[1], Success)])
        if successes:
            rows = yield Statement(self.complete, {"claims": completion_claims(successes)},
                                   scalar=True)  # the ids of the jobs completed
            written = set(rows)
            if self.retrying and len(written) < len(successes):
                written |= yield from self.landed_before(
                    [h for h, _ in successes if h.job.id not in written])
            state, stale = self.state, 0
            for held, _ in successes:  # per job: kept lean, this is the drain's hot path
                if held.job.id in written:
                    state.settled(held, "done")
                else:
                    stale += 1
                    self._lost(held)
            if stale < len(successes):
                guarded(state.events.recorded, "done", len(successes) - stale)
            if stale:
                guarded(state.events.recorded, "lost", stale)
            state.wake.set()  # room for the claimer
            batch[:] = [pair for pair in batch if not isinstance(pair[1], Success)]
        if batch:
            yield from self.settle(batch, decided or {})

    def settle(self, batch: list[tuple[Held, Outcome]],
               decided: dict[int, Decision]) -> Step[None]:
        """Write the outcomes of ``batch`` that are no success, in one fenced ``settle``
        (``decided``: settlements already taken, by job id), and report each as written."""
        # Released and throttled jobs go back with their attempt refunded.
        settles = [(h, isinstance(o, Release | Throttled),
                    decided.get(h.job.id) or self.settlement(h, o)) for h, o in batch]
        claims = [settle_claim(h.job, d, refund=released) for h, released, d in settles]
        rows = yield Statement(self.queries.settle, {"claims": settle_claims(claims)})
        settled = dict(rows)  # (id, cancelled) of each job settled: which claim was written
        counts: Counter[AttemptOutcome] = Counter()
        for (held, _, decision), claim in zip(settles, claims, strict=True):
            cancelled = settled.get(held.job.id)
            if cancelled is None:
                outcome: AttemptOutcome = "lost"
                self._lost(held)
            else:
                if cancelled:
                    self.cancelled_meanwhile(held, decision, claim)
                outcome = reported(claim, cancelled=cancelled)
                self.state.settled(held, outcome)
            counts[outcome] += 1
        for outcome, count in counts.items():
            guarded(self.state.events.recorded, outcome, count)
        if counts["released"]:
            self.owe_shared_tokens(batch, settled)
        self.state.wake.set()  # room for the claimer
        batch.clear()

    def owe_shared_tokens(self, batch: list[tuple[Held, Outcome]],
                          settled: dict[int, bool]) -> None:
        """The claims handed back unperformed (``Release``, written as such: not
        cancelled meanwhile) of effects under a shared limit spent a token each in the
        limits home: owed back to it (``HomeBudget.owe``), so a job claimed again costs
        the shared rate one token in all, not one a claim. (A ``Throttled`` attempt did
        call the provider: its token was used.)"""
        home = self.settings.limits_home
        if home is None:
            return
        owed: Counter[str] = Counter()
        for held, outcome in batch:
            limit = self.settings.limits.get(held.job.effect)
            if (isinstance(outcome, Release) and limit is not None and limit.shared
                    and settled.get(held.job.id) is False):
                owed[held.job.effect] += 1
        budget = home_budget(home)
        for effect, count in owed.items():
            budget.owe(effect, count)

    def landed_before(self, helds: list[Held]) -> Step[set[int]]:
        """Ids among ``helds`` whose completion by this very claim already committed: a
        retried batch whose first attempt landed but whose reply was lost. Read from the
        ledger (job id and claim version), which a completion writes whether it updates
        the job row or, with retention 0, deletes it; found by the jobs' keys."""
        rows = yield Statement(self.queries.recorded_claims,
                               {"claims": recorded_claims(helds)},
                               scalar=True)  # the ids of the jobs whose claim recorded
        return set(rows)

    def record_singly(self, batch: list[tuple[Held, Outcome]],
                      decided: dict[int, Decision]) -> Step[None]:
        """Fallback after a batch failed for a reason other than the connection: record
        each outcome alone so one bad row cannot block the rest. An outcome that still
        cannot be written is dropped here; its lease expires and the rescuer retries it,
        so it counts an attempt and ends ``failed`` rather than looping forever."""
        for item in list(batch):
            try:
                yield from self.record([item], decided)
            except CONNECTION_ERRORS:
                raise
            except psycopg.Error as exc:
                held, _ = item
                self.state.drop(held, exc)
                log.error("job %s (key %s): outcome could not be recorded (%s); the lease "
                          "will expire and the job be retried", held.job.id, held.job.key,
                          getattr(exc, "sqlstate", None) or type(exc).__name__)
            batch.remove(item)

    def settlement(self, held: Held, outcome: Outcome) -> Decision:
        """Where a failed (or released) attempt sends the job (``_lifecycle.settle``)."""
        settled = _lifecycle.RELEASED if isinstance(outcome, Release) else outcome
        assert not isinstance(settled, Success)
        decision = _lifecycle.settle(settled, held.job, self.rules(held), now=datetime.now(UTC),
                                 rng=self.rng, told=signal_of(held.job).reason)
        if settled is not _lifecycle.RELEASED and not isinstance(settled, Throttled):
            log.log(
                logging.WARNING if decision.status != "pending" else logging.INFO,
                "job %s (key %s) attempt %s -> %s: %s",
                held.job.id, held.job.key, held.job.attempt, decision.status,
                # The reason as last_error stores it ("Permanent: card declined"), shortened.
                decision.error[:300] if decision.error else type(settled).__name__,
            )
        return decision

    def cancelled_meanwhile(self, held: Held, decision: Decision,
                            claim: dict[str, Any]) -> None:
        """``settle`` found ``held``'s claim cancelled by an operator after it was
        settled as ``decision``, and wrote ``claim``'s decision for that case
        (``as_written``): said in the log when it differs from what was decided."""
        wrote = as_written(claim, cancelled=True)
        if (wrote.status, wrote.error) != (decision.status, decision.error):
            log.warning("job %s (key %s) attempt %s: an operator cancelled its claim before "
                        "its outcome (%s) was written -> %s: %s", held.job.id, held.job.key,
                        held.job.attempt, decision.status, wrote.status,
                        (wrote.error or "")[:300])

    def rules(self, held: Held) -> _lifecycle.Rules:
        """The rules that settle ``held``'s attempts (its window, the backoff, whether
        its effect reconciles)."""
        return _lifecycle.Rules(window=self.settings.window_for(held.effect),
                            backoff=self.settings.backoff,
                            reconciles=held.job.effect in self.reconciling)

    def lost(self, held: Held) -> None:
        """``held``'s fenced write changed nothing (see ``_lost``)."""
        self._lost(held)

    def _lost(self, held: Held) -> None:
        """``held``'s fenced write changed nothing: its claim was lost (a stale
        completion, counted per batch by the caller)."""
        log.warning("job %s (key %s): claim version %s was lost before its outcome "
                    "was recorded; the newer claim decides", held.job.id, held.job.key,
                    held.job.claim_version)
        self.state.settled(held, "lost")

    def failed(self, exc: BaseException, *, lost: bool,
               pending: list[tuple[Held, Outcome]]) -> None:
        """A statement failed on the connection: the batch left in ``pending`` is sent
        again (``retrying``); a lost connection is counted as a reconnect."""
        self.retrying = bool(pending) or self.hooked_waiting
        if isinstance(exc, ReadOnlyServer):  # a standby: said once, as it was met
            return
        if lost:
            guarded(self.state.events.reconnected, "recorder")
            log.warning("recorder lost its connection (%s); reconnecting", type(exc).__name__)
        else:  # transient (40001, 40P01, 55P03, 57014): retry the same batch
            log.error("recorder statement failed: %s; retrying",
                      getattr(exc, "sqlstate", None) or type(exc).__name__)

    # -- leases -----------------------------------------------------------------------

    def heartbeat(self) -> Step[None]:
        """Extend the leases of every claim held; mark those found lost."""
        sent = time.monotonic()  # the leases renewed run at least until sent + lease
        held = [h for h in list(self.state.held.values()) if not h.lost]
        if not held:
            self.state.watch.renewed = sent
            return
        rows = yield Statement(self.queries.heartbeat, {"claims": fenced_claims(held),
                                                        "lease": self.settings.lease},
                               named=True)
        # (id, cancel) of each lease extended; cancel: an operator cancelled the claim
        alive = {row.id for row in rows}
        self.state.watch.renewed = sent
        told_to_stop(self.state, [row.id for row in rows if row.cancel])
        lost = 0
        for h in held:
            if h.job.id not in alive and h.job.id in self.state.held:
                self.state.lose(h)
                lost += 1
                log.warning("job %s (key %s): heartbeat found claim version %s lost",
                            h.job.id, h.job.key, h.job.claim_version)
        if lost:
            guarded(self.state.events.claims_lost, lost)

    def finished(self, pending: list[tuple[Held, Outcome]]) -> bool:
        """Whether the recorder may end: the dispatcher stops, its workers are done
        and every outcome is written (or, after a part died, nothing more will come)."""
        state = self.state
        if state.abandoned and state.workers_done and self.retrying:
            return True  # stop_timeout passed and the database does not answer: left
        return (state.stopping.is_set() and state.workers_done and not pending
                and not state.outcomes and not self.hooked_waiting)

    @property
    def hooked_waiting(self) -> bool:
        """Whether hooked outcomes wait to be written (``flush_hooked``)."""
        return self.hooked is not None and bool(self.hooked.items)


# -- the loop: written once as a program (``runtime``), ``Dispatcher``'s driven on a
# -- thread, ``AsyncDispatcher``'s as a task -------------------------------------------------


def recording(recorder: Recorder, conn: Connection | AsyncConnection) -> Program[None]:
    """The recorder's loop, until ``Recorder.finished``: outcomes written as they come,
    hooked ones in transactions of their own, the leases heartbeaten when due."""
    state = recorder.state
    heartbeat = _heartbeat_timer(recorder.settings)
    pending: list[tuple[Held, Outcome]] = []

    def beat() -> Program[None]:
        """Between the transactions of a long hooked write: the heartbeat, if due."""
        if heartbeat.due(time.monotonic()):
            try:
                yield Run(recorder.heartbeat(), conn)
            except CONNECTION_ERRORS:
                raise
            except psycopg.Error as exc:
                _heartbeat_failed(exc)

    try:
        while not recorder.finished(pending):
            yield Wait(state.outcome_ready, min(heartbeat.interval, 0.5))
            state.outcome_ready.clear()
            pending.extend(state.take_outcomes())
            try:
                if pending:
                    yield Run(recorder.flush(pending), conn)
                if recorder.hooked is not None and recorder.hooked_waiting:
                    yield from flush_hooked(recorder.hooked, conn, beat)
                recorder.retrying = False
                if heartbeat.due(time.monotonic()):
                    yield Run(recorder.heartbeat(), conn)
            except CONNECTION_ERRORS as exc:
                recorder.failed(exc, lost=conn.lost, pending=pending)
                yield Sleep(conn.backoff())
            except ConfigurationError:
                raise  # a missing privilege: no retry will help
            except psycopg.Error as exc:  # a heartbeat statement failed: next round
                _heartbeat_failed(exc)
                yield Sleep(conn.backoff())
            # Anything else is a bug: it ends the recorder, and the run raises
            # DispatcherFailed (supervised) rather than repeating while leases expire.
    finally:
        close_quietly(recorder.hooked)
        yield Call(conn.discard)


def _heartbeat_timer(settings: Settings) -> Timer:
    """When the leases held are extended: first one interval after the recorder starts
    (the claim has just set them)."""
    heartbeat = Timer(_lifecycle.heartbeat_interval(settings.lease))
    heartbeat.next_at = time.monotonic() + heartbeat.interval
    return heartbeat


def _heartbeat_failed(exc: psycopg.Error) -> None:
    log.error("heartbeat failed: %s", getattr(exc, "sqlstate", None) or type(exc).__name__)
