"""Hooked outcomes: the recorder's per-job path for outcomes whose effect has a completion
hook, and how a hook is called inside a transaction (``call_hook``, also the reconciler's).

Outcomes without hooks keep the recorder's batched statements. Outcomes with one are
written here in chunks, each in one transaction, with the recorder's heartbeat (when
due) between them: a chunk is sized to take at most half a heartbeat interval at the
pace the last chunk was written (``HookedOutcomes.took``), and holds at most
``HOOKED_CHUNK_MAX`` outcomes. First optimistically (``fast``): the
chunk's fenced status changes in one statement each (done + ledger rows; failed), then
each hook whose job's fence held, called one after the other by one instruction
(``CallHooks``), their statements in one pipeline (one wait for them all, not a round
trip a hook), then COMMIT. Should any hook raise, that
transaction is rolled back whole and the chunk is written again (``mended``): the
raising job settled from its hook's error in one fenced statement (the hook not called
again), the rest in segments of ``HOOKED_SEGMENT``, each the same fast write inside a
savepoint (released, and the next one set, in the hooks' pipeline); a segment whose
hook raises is rolled back to its savepoint, which stays set, and the rest of the
segment written again inside it; the raising jobs are settled so at the end of the
chunk, out of every segment. After a chunk with a raise, the next is written hooks first
(``locked``) if every hook that raised had sent no statement yet (``CallHooks`` counts
what each sends): the chunk's done jobs locked, fenced (a lost claim runs no hook), their
hooks called, and only then the completion of those whose hook returned, so that a hook
that raises before writing costs one fenced statement and nothing else; otherwise the
next is written in segments from the start. A statement's error, whose hook is not
known in a pipeline, sends its segment to be written carefully (``careful``), each job
inside a savepoint of its own::

    SAVEPOINT
      the fenced status change (done + ledger row, or failed)   0 rows: claim lost, no hook
      the hook (its writes, its follow-up jobs)
    RELEASE                       or, if the hook raised:   ROLLBACK TO SAVEPOINT
                                                            the fenced retry / failure
COMMIT

so a hook that raises leaves nothing half-written and does not disturb the other jobs of
the batch, and hooks that do not raise cost their own statements only. A hook may thus
be called more than once for one outcome (the earlier calls' writes rolled back): only
what it writes through ``tx`` is once.

The decisions are written once, as steps (``outbox._steps``) that yield ``Statement``s
(run in the transaction), ``CallHook``s (the hook called with a transaction object of
the flavour) and ``CallHooks`` (a chunk's hooks, their statements in one pipeline):
``in_transaction`` and ``in_transaction_async`` execute them, both flavours pipelined
alike, and the steps' two drivers run them. ``writing_hooked`` (a program of
``runtime``) writes on either flavour's connection; on ``AsyncDispatcher``'s, its sync
hooks' items go to the same program driven on a thread, with a blocking connection of
their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from typing import Any, NoReturn, Protocol, TypeVar, cast

import psycopg

from .. import _lifecycle
from .._lifecycle import Decision
from .._sql import Queries
from .._steps import Rows, Statement, Step, execute, execute_async
from ..effect import Job
from ..flows import AsyncHookTransaction, HookTransaction
from ..observe import AttemptOutcome
from .collector import collection_paused
from .connection import CONNECTION_ERRORS, AsyncConnection, Connection, connect
from .flowsql import flow_queries
from .hook_lookup import is_async_hook
from .runtime import Blocking, Call, Program, Transaction, drive
from .settings import Settings
from .settling import (
    completion_claims,
    fenced_claims,
    reported,
    settle_claim,
    settle_claims,
)
from .state import Held, Outcome, SharedState, Success, guarded

__all__ = ["HOOKED_CHUNK_MAX", "CallHook", "CallHooks", "HookRaised", "HookStep", "Hooked",
           "HookedOutcomes", "call_hook", "in_transaction", "in_transaction_async",
           "with_hooks", "writing_hooked"]

log = logging.getLogger("outbox.dispatcher")

T = TypeVar("T")

SAVEPOINT = Statement("SAVEPOINT outbox_hook", {})
RELEASE = Statement("RELEASE SAVEPOINT outbox_hook", {})
ROLLBACK = Statement("ROLLBACK TO SAVEPOINT outbox_hook", {})
SEGMENT = Statement("SAVEPOINT outbox_segment", {})
SEGMENT_RELEASE = Statement("RELEASE SAVEPOINT outbox_segment", {})
SEGMENT_ROLLBACK = Statement("ROLLBACK TO SAVEPOINT outbox_segment", {})
# Ours, rolling back a hook's writes only (never a table's creation): psycopg's prepared
# statements are kept across them (``_rolled_back_to``).
_ROLLBACKS = frozenset((ROLLBACK.query, SEGMENT_ROLLBACK.query))


@dataclass(frozen=True, slots=True)
class CallHook:
    """Call ``fn(tx, job, value)`` in the transaction; the step receives the ids of the
    follow-up jobs it created."""

    fn: Callable[..., Any]
    job: Job
    value: Any


@dataclass(frozen=True, slots=True)
class CallHooks:
    """Call each of ``calls``, in order, in the transaction, their statements in one
    psycopg pipeline, sent ``SENT_TOGETHER`` at a time or when a hook waits for an
    answer (``_sent_together``), then waited for once, with the check that no hook
    left the transaction aborted.
    A hook that raises stops the calls: ``HookRaised`` with ``at`` its index (and
    ``clean`` if it had sent no statement); a statement's error (whose hook is not
    known: in a pipeline it shows at a later statement, or at the wait) ``HookRaised``
    with ``at`` None. With ``tolerant``, a hook that raises before sending any statement
    (not a psycopg error) does not stop the calls: nothing of it is in the transaction.
    Answers those hooks' errors by their index (``tolerant``; else none). Python's
    cyclic garbage collector waits while the hooks are called
    (``collector.collection_paused``).
    In the same pipeline: ``adopt`` (the follow-ups' adoption, ``adopt_followups``)
    after each hook that created follow-ups, and after the check the commands ``then``
    (a segment's release and the next one's savepoint: ``mended``), none of which runs
    if a hook raised."""

    calls: list[CallHook]
    adopt: str | None = None
    then: tuple[str, ...] = ()
    tolerant: bool = False


HOOKED_CHUNK_MAX = 500
"""At most this many hooked outcomes are written in one transaction, however fast their
hooks: past a few hundred a commit costs nothing more worth saving, while a hook that
raises sends its whole chunk back to be written again carefully (``careful``), and the
chunk's completion statement carries every one of its outcomes."""

HOOKED_SEGMENT = 32
"""After a hook raised, its chunk is written again in segments of this many outcomes,
each in a savepoint (``mended``): a hook that raises again costs the rewrite of its
segment (the hooks before it called again), not a savepoint for every job of the chunk."""

HOOKED_CHUNK_FIRST = 32
"""The first chunk, before the hooks' pace is known: 32 hooks of 20 ms each (slow hooks)
take 0.64 s, inside the heartbeat interval of a lease of 2 s (0.67 s), and a commit per
32 cheap hooks is already a small part of their statements."""


class HookRaised(Exception):
    """Thrown into the step (raised by its executor): the hook raised ``error``; for
    ``CallHooks``, ``at`` is the index of that hook (None: not known). ``clean``: the
    hook had sent no statement when it raised (``CallHooks`` counts them), so nothing
    of it needs rolling back."""

    def __init__(self, error: Exception, at: int | None = None, *,
                 clean: bool = False) -> None:
        super().__init__(error)
        self.error = error
        self.at = at
        self.clean = clean


# What makes the optimistic write of a batch go careful: a hook raised, or left the
# transaction aborted (a statement error it swallowed shows on the next statement).
_HOOK_TROUBLE = (HookRaised, psycopg.Error)


class HookLeftAborted(Exception):
    """The hook returned normally, but one of its statements had failed."""


HookStep = Generator[Statement | CallHook | CallHooks, Any, T]
"""A step that calls hooks: yields ``Statement`` (sent rows), ``CallHook`` (sent the
ids of the follow-up jobs the hook created) and ``CallHooks`` (sent those of each)."""


@dataclass(eq=False, slots=True)
class Hooked:
    """An outcome to record with its hook."""

    held: Held
    outcome: Outcome
    hook: Callable[..., Any]
    decision: Decision | None = None  # the settlement of a failure (to failed)
    is_async: bool | None = None  # None: looked up here (``take`` knows it already)
    raised: Exception | None = None  # what its hook raised in ``fast`` (rolled back)

    def __post_init__(self) -> None:
        if self.is_async is None:
            self.is_async = is_async_hook(self.hook)


def _successes(items: Iterable[Hooked]) -> Iterator[tuple[Held, Success]]:
    """The (held, success) pairs of hooked items whose outcome is a success."""
    return ((item.held, cast(Success, item.outcome)) for item in items)


class Recording(Protocol):
    """What the hooked path shares with the recorder that owns it (``Recorder``): its
    options, state and statements, its retry flag, and the jitter and rules that settle
    an outcome."""

    settings: Settings
    state: SharedState[Any]
    queries: Queries
    complete: str  # the completion statement (update, or delete with retention 0)
    retrying: bool
    rng: random.Random

    def rules(self, held: Held) -> _lifecycle.Rules: ...

    def landed_before(self, helds: list[Held]) -> Step[set[int]]: ...

    def lost(self, held: Held) -> None: ...


class HookedOutcomes:
    """The hooked outcomes the recorder holds, and the step that writes them."""

    def __init__(self, recorder: Recording) -> None:
        self.recorder = recorder
        self.settings = recorder.settings
        self.queries = flow_queries(recorder.settings.schema)
        self.items: list[Hooked] = []
        self.sync_conn: Connection | None = None  # AsyncDispatcher's, for sync hooks
        # The recorder heartbeats only between transactions: a chunk taking at most half
        # an interval keeps every lease held at least half its length ahead.
        self.chunk_seconds = _lifecycle.heartbeat_interval(recorder.settings.lease) / 2
        self.chunk_size = HOOKED_CHUNK_FIRST
        self.calling: Hooked | None = None  # the hook ``fast`` is calling
        self.then_ran = False  # the last ``CallHooks`` ran its ``then``
        # A hook raised in the last chunk: the next is written ``locked`` (every hook that
        # raised had sent nothing) or in segments (one had: ``dirty``).
        self.raising = False
        self.dirty = False
        # Whether each hook is ``async def``: asked once, not per outcome.
        self.asynchronous = {id(fn): is_async_hook(fn) for hooks in (
            recorder.settings.done_hooks, recorder.settings.failed_hooks)
            for fn in hooks.values()}

    def next_chunk(self) -> list[Hooked]:
        """The outcomes the next transaction writes: the oldest ``chunk_size``."""
        return self.items[:self.chunk_size]

    def took(self, count: int, seconds: float) -> None:
        """A chunk of ``count`` outcomes was written in ``seconds``: size the next one to
        take ``chunk_seconds`` at that pace (at least 1, at most ``HOOKED_CHUNK_MAX``)."""
        per_outcome = max(seconds / count, 1e-6)
        self.chunk_size = max(1, min(HOOKED_CHUNK_MAX, int(self.chunk_seconds / per_outcome)))

    def take(self, pending: list[tuple[Held, Outcome]],
             settle: Callable[[Held, Outcome], Decision]) -> dict[int, Decision]:
        """Move the outcomes whose effect has a hook for them out of ``pending``: a
        success with an ``on_done``, a failure with an ``on_failed`` that ``settle``
        sends to failed. The settlements taken for the failures left in ``pending``
        are returned (by job id), so that nothing is settled twice."""
        done, failed = self.settings.done_hooks, self.settings.failed_hooks
        decided: dict[int, Decision] = {}
        rest: list[tuple[Held, Outcome]] = []
        for held, outcome in pending:
            name = held.job.effect
            if isinstance(outcome, Success) and name in done:
                hook = done[name]
                self.items.append(Hooked(held, outcome, hook,
                                         is_async=self.asynchronous.get(id(hook))))
                continue
            if isinstance(outcome, BaseException) and name in failed:
                decision = settle(held, outcome)
                if decision.status == "failed":
                    hook = failed[name]
                    self.items.append(Hooked(held, outcome, hook, decision,
                                             self.asynchronous.get(id(hook))))
                    continue
                decided[held.job.id] = decision
            rest.append((held, outcome))
        pending[:] = rest
        return decided

    # -- the steps -----------------------------------------------------------------------

    def fast(self, items: list[Hooked]) -> HookStep[list[AttemptOutcome]]:
        """Write ``items`` optimistically (``optimistic``); but after a chunk in which a
        hook raised, hooks first (``locked``) if every hook that raised had sent no
        statement, else in savepointed segments from the start (``mended``): hooks that
        raised in the last chunk are likely to raise in this one (1 in 100 raising
        leaves few chunks of hundreds without one), and an optimistic write rolled back
        costs every hook called before the raise."""
        raising, dirty = self.raising, self.dirty
        self.raising = self.dirty = False  # again only if a hook raises in this chunk
        if raising and len(items) > 1:
            if dirty:
                return (yield from self.mended(items))
            return (yield from self.locked(items))
        return (yield from self.optimistic(items))

    def locked(self, items: list[Hooked]) -> HookStep[list[AttemptOutcome]]:
        """Write ``items`` hooks first, no savepoint: the jobs of the successes locked
        (``lock_claims``: a claim lost meanwhile is not locked, and runs no hook), their
        hooks called in one pipeline, then the completion of those whose hook returned,
        in one statement, and each whose hook raised before sending any statement
        settled from its error (nothing of that hook is in the transaction: no rollback,
        no other hook called twice). A hook that raises after sending a statement, or a
        statement's error, propagates as in ``optimistic`` (the caller rolls back and
        goes ``mended``). The failures are written as ``optimistic`` writes them."""
        outcomes: dict[int, AttemptOutcome] = {}
        done = [i for i in items if isinstance(i.outcome, Success)]
        failed = [i for i in items if not isinstance(i.outcome, Success)]
        if done:
            locked = set((yield Statement(self.recorder.queries.lock_claims, {
                "claims": fenced_claims(i.held for i in done)}, scalar=True)))
            mine = [i for i in done if i.held.job.id in locked]
            unlocked = [i for i in done if i.held.job.id not in locked]
            landed: set[int] = set()
            if unlocked and self.recorder.retrying:  # our own commit may have landed
                landed = yield from self.recorder.landed_before([i.held for i in unlocked])
            for item in unlocked:
                outcomes[id(item)] = "done" if item.held.job.id in landed else "lost"
            if mine:
                refused = yield from self._fast_hooks(
                    [(i, json.loads(i.outcome.result_json))  # type: ignore[union-attr]
                     for i in mine], tolerant=True)
                returned = [i for at, i in enumerate(mine) if at not in refused]
                if returned:
                    yield from self._completed(returned)
                    for item in returned:
                        outcomes[id(item)] = "done"
                for at, error in refused.items():
                    outcomes[id(mine[at])] = yield from self._raised(mine[at], error)
                if refused:
                    self.raising = True
        if failed:
            outcomes.update(zip(map(id, failed), (yield from self.optimistic(failed)),
                                strict=True))
        return [outcomes[id(item)] for item in items]

    def _completed(self, items: list[Hooked]) -> HookStep[None]:
        """The completion of ``items``, whose jobs this transaction locked (``locked``):
        each is written, or the hooks' writes must not commit (a lost claim's)."""
        rows = yield Statement(self.recorder.complete,
                               {"claims": completion_claims(_successes(items))}, scalar=True)
        if len(rows) != len(items):  # cannot happen while the locks hold
            raise HookRaised(RuntimeError(
                f"{len(items) - len(rows)} locked claims were not completed"))

    def optimistic(self, items: list[Hooked],
                   then: tuple[str, ...] = ()) -> HookStep[list[AttemptOutcome]]:
        """Write ``items`` with one statement per kind and no savepoints, then call the
        hooks of the jobs whose fence held, their statements pipelined (``Pipelined``:
        one wait for them all, not a round trip a hook). Anything a hook raises
        propagates (the caller rolls back and goes ``mended``), with ``calling`` the
        hook to blame, or None when unknown (a statement's error, which in a pipeline
        may show in a later hook's call, or only when the pipeline is left).
        ``then``: commands sent after the hooks, in their pipeline (``CallHooks``);
        ``then_ran`` says whether they were (not if no hook was called)."""
        self.then_ran = False
        outcomes: dict[int, AttemptOutcome] = {}
        calls: list[tuple[Hooked, Any]] = []  # the hooks to call, with their values
        done = [i for i in items if isinstance(i.outcome, Success)]
        failed = [i for i in items if not isinstance(i.outcome, Success)]
        if done:
            rows = yield Statement(self.recorder.complete,
                                   {"claims": completion_claims(_successes(done))},
                                   scalar=True)  # the ids of the jobs completed
            written = set(rows)
            landed: set[int] = set()
            if self.recorder.retrying and len(written) < len(done):
                landed = yield from self.recorder.landed_before(
                    [i.held for i in done if i.held.job.id not in written])
            for item in done:
                job = item.held.job
                if job.id in written:
                    calls.append((item, json.loads(item.outcome.result_json)))  # type: ignore[union-attr]
                outcomes[id(item)] = "done" if job.id in written | landed else "lost"
        if failed:
            settling = [settle_claim(i.held.job, Decision(
                "failed", error=i.decision.error if i.decision else None)) for i in failed]
            rows = yield Statement(self.recorder.queries.settle,
                                   {"claims": settle_claims(settling)})
            settled = dict(rows)  # (id, cancelled) of each job settled
            for item, claim in zip(failed, settling, strict=True):
                cancelled = settled.get(item.held.job.id)
                if cancelled is None:
                    outcomes[id(item)] = "lost"
                    continue
                calls.append((item, item.outcome))
                outcomes[id(item)] = reported(claim, cancelled=cancelled)
        if calls:
            yield from self._fast_hooks(calls, then)
        return [outcomes[id(item)] for item in items]

    def _fast_hooks(self, calls: list[tuple[Hooked, Any]], then: tuple[str, ...] = (),
                    *, tolerant: bool = False) -> HookStep[dict[int, Exception]]:
        """Call each hook of ``calls``, their statements and their follow-ups'
        adoptions in one pipeline (``CallHooks``: one instruction for them all, one wait
        for their statements), then ``then``. Only the hooks and what follows them run
        in the pipeline: what our statements before answer is known when they return.
        A hook that raises is ``calling`` (``mended`` settles its job from ``raised``);
        a statement's error leaves ``calling`` None. ``tolerant``: the hooks that raised
        before sending any statement, by their index in ``calls``, are answered instead
        (``CallHooks``)."""
        self.calling = None
        try:
            refused: dict[int, Exception] = yield CallHooks(
                [CallHook(item.hook, item.held.job, value) for item, value in calls],
                self.queries.adopt_followups, then, tolerant)
        except HookRaised as raised:
            self.raising = True
            self.dirty = self.dirty or not raised.clean
            # A psycopg error, even raised through a hook, may be an earlier hook's
            # statement's: whose, unknown.
            if raised.at is not None and not isinstance(raised.error, psycopg.Error):
                item = calls[raised.at][0]
                item.raised = raised.error  # settled as it says (``mended``)
                self.calling = item
            raise
        self.then_ran = True
        return refused

    def mended(self, items: list[Hooked],
               culprit: Hooked | None = None) -> HookStep[list[AttemptOutcome]]:
        """Write ``items`` again after a hook raised in ``fast``: in segments of
        ``HOOKED_SEGMENT``, each ``optimistic`` inside a savepoint of its own. A segment whose
        hook raises is rolled back to its savepoint, the raising job written ``careful``ly
        (its retry or failure), and the rest of the segment written again; a segment
        whose hook left the transaction aborted, or whose statement failed (which hook,
        unknown: in a pipeline the error may show later), goes ``careful`` whole. So a
        hook that raises costs its segment, not its chunk, a savepoint a job. The rest
        of a segment is written again inside the same savepoint (a rollback to it keeps
        it), and the jobs whose hooks raised are settled at the end, out of every
        segment, so that no rollback undoes their settlement. ``culprit``, the job whose
        hook raised in ``fast``, is one of them."""
        written: dict[int, AttemptOutcome] = {}
        queue = list(items)
        culprits: list[Hooked] = []
        if culprit is not None and culprit in queue:
            culprits.append(culprit)
            queue.remove(culprit)
        opened = False  # the next segment's savepoint set (by the last one's ``then``)
        while queue:
            segment, queue = queue[:HOOKED_SEGMENT], queue[HOOKED_SEGMENT:]
            self.calling = None
            if not opened:
                yield SEGMENT
            opened = False
            # Released, and the next one's savepoint set, in the hooks' pipeline.
            then = (SEGMENT_RELEASE.query, SEGMENT.query) if queue else (SEGMENT_RELEASE.query,)
            try:
                outcomes = yield from self.optimistic(segment, then)
            except HookRaised:
                culprit = self.calling
                yield SEGMENT_ROLLBACK  # the savepoint stays set
                if culprit is None:  # a statement's error, whose hook is unknown
                    yield SEGMENT_RELEASE
                    outcomes = yield from self.careful(segment)
                else:
                    culprits.append(culprit)
                    queue = [item for item in segment if item is not culprit] + queue
                    opened = True  # the rest written again inside the same savepoint
                    continue
            except CONNECTION_ERRORS:
                raise
            except psycopg.Error:  # a hook left the transaction aborted
                yield SEGMENT_ROLLBACK
                yield SEGMENT_RELEASE
                outcomes = yield from self.careful(segment)
            else:
                if self.then_ran:
                    opened = bool(queue)
                else:  # no hook called (every claim of the segment lost)
                    yield SEGMENT_RELEASE
            written.update(zip(map(id, segment), outcomes, strict=True))
        for raised in culprits:
            written[id(raised)] = yield from self._culprit(raised)
        return [written[id(item)] for item in items]

    def _culprit(self, item: Hooked) -> HookStep[AttemptOutcome]:
        """A job whose hook raised (in ``fast``, or in a segment: that write rolled
        back): settled as its hook's error says, in one fenced statement, the hook not
        called again; without the error (not the hook's own), written ``careful``ly."""
        if item.raised is None:
            [outcome] = yield from self.careful([item])
            return outcome
        return (yield from self._raised(item, item.raised))

    def careful(self, items: list[Hooked]) -> HookStep[list[AttemptOutcome]]:
        """Write ``items``, each in its savepoint; what each became, in order."""
        written: list[AttemptOutcome] = []
        for item in items:
            yield SAVEPOINT
            if isinstance(item.outcome, Success):
                outcome = yield from self._done(item, item.outcome)
            else:
                outcome = yield from self._failed(item)
            yield RELEASE
            written.append(outcome)
        return written

    def _done(self, item: Hooked, success: Success) -> HookStep[AttemptOutcome]:
        rows = yield Statement(self.recorder.complete,
                               {"claims": completion_claims([(item.held, success)])})
        if not rows:
            if self.recorder.retrying and (yield from self.recorder.landed_before([item.held])):
                return "done"  # our own commit landed; its reply was lost
            return "lost"
        error = yield from self._hook(item, json.loads(success.result_json))
        if error is None:
            return "done"
        yield ROLLBACK
        return (yield from self._raised(item, error))

    def _raised(self, item: Hooked, error: Exception) -> HookStep[AttemptOutcome]:
        """Settle the job whose hook raised ``error``, its status change and the hook's
        writes rolled back: retried or failed as ``_lifecycle.settle`` says, fenced;
        an ``on_done``'s provider answer kept (not performed again)."""
        job = item.held.job
        if isinstance(item.outcome, BaseException):  # on_failed's
            retry = self._settle_hook_error(item, item.outcome, error)
            log.warning("job %s (key %s) attempt %s: on_failed raised %s -> %s", job.id,
                        job.key, job.attempt, type(error).__name__, retry.status)
            claim = settle_claim(job, retry)
            rows = yield from self._settled(claim)
            if not rows:
                return "lost"
            [(_, cancelled)] = rows  # one claim settled: (id, cancelled)
            if cancelled and claim["cancelled_status"] != retry.status:
                # An operator's cancel came after the retry was decided: written failed.
                log.warning("job %s (key %s): an operator cancelled its claim before its "
                            "%s was written -> %s", job.id, job.key, retry.status,
                            claim["cancelled_status"])
            return reported(claim, cancelled=cancelled)
        success = item.outcome
        assert isinstance(success, Success)
        decision = self._settle_hook_error(item, None, error)
        params = {"id": job.id, "version": job.claim_version, "result": success.result_json,
                  "delay": decision.delay, "error": decision.error}
        log.warning("job %s (key %s) attempt %s: on_done raised %s -> %s (the provider's "
                    "answer is kept: it is not performed again)", job.id, job.key,
                    job.attempt, type(error).__name__, decision.status)
        if decision.status == "pending":
            rows = yield Statement(self.queries.keep_result, params)
            return "retry" if rows else "lost"
        rows = yield Statement(self.queries.fail_performed, params)
        return "failed" if rows else "lost"

    def _failed(self, item: Hooked) -> HookStep[AttemptOutcome]:
        job, decision = item.held.job, item.decision
        assert decision is not None and isinstance(item.outcome, BaseException)
        rows = yield from self._settle(job, Decision("failed", error=decision.error))
        if not rows:
            return "lost"
        error = yield from self._hook(item, item.outcome)
        if error is None:
            return "failed"
        yield ROLLBACK
        return (yield from self._raised(item, error))

    def _settle(self, job: Job, decision: Decision) -> HookStep[Rows]:
        """``job``'s claim settled as ``decision``: ``settle``'s rows, (id, cancelled)."""
        return (yield from self._settled(settle_claim(job, decision)))

    def _settled(self, claim: dict[str, Any]) -> HookStep[Rows]:
        """``settle`` of one claim (``settle_claim``'s): its rows, (id, cancelled)."""
        rows: Rows = yield Statement(self.recorder.queries.settle, {
            "claims": settle_claims([claim])})
        return rows

    def _settle_hook_error(self, item: Hooked, outcome: BaseException | None,
                           error: Exception) -> Decision:
        """Where the job goes after its hook raised ``error`` (``_lifecycle.settle``)."""
        return _lifecycle.settle(outcome, item.held.job, self.recorder.rules(item.held),
                             now=datetime.now(UTC), rng=self.recorder.rng, hook_error=error)

    def _hook(self, item: Hooked, value: Any) -> HookStep[Exception | None]:
        return (yield from call_hook(item.hook, item.held.job, value, self.queries))

    # -- after the commit ----------------------------------------------------------------

    def applied(self, items: list[Hooked], written: list[AttemptOutcome]) -> None:
        """The transaction writing ``items`` committed: settle them and count."""
        recorder, state = self.recorder, self.recorder.state
        counts: Counter[AttemptOutcome] = Counter()
        for item, outcome in zip(items, written, strict=True):
            if outcome == "lost":
                recorder.lost(item.held)
            else:
                state.settled(item.held, outcome)
            counts[outcome] += 1
        for outcome, count in counts.items():
            guarded(state.events.recorded, outcome, count)
        done = set(map(id, items))
        self.items = [i for i in self.items if id(i) not in done]
        state.wake.set()

    def close(self) -> None:
        if self.sync_conn is not None:
            self.sync_conn.discard()


def call_hook(fn: Callable[..., Any], job: Job, value: Any,
              queries: Any) -> HookStep[Exception | None]:
    """Call ``fn(tx, job, value)`` and adopt its follow-ups; the error if it (or what it
    left behind: an aborted transaction) failed, else None. The caller rolls back to its
    savepoint on an error."""
    try:
        created = yield CallHook(fn, job, value)
        if created:
            yield Statement(queries.adopt_followups, {"parent": job.key, "ids": created})
        yield Statement("SELECT 1", {})  # fails if the hook left the transaction aborted
    except HookRaised as raised:
        return raised.error
    except CONNECTION_ERRORS:
        raise
    except psycopg.Error as exc:  # the hook swallowed an error of its own statement
        return HookLeftAborted(
            "the hook returned with its transaction aborted (it caught an error of one "
            f"of its statements: {type(exc).__name__}); nothing it wrote was kept")
    return None


# -- executors: a transaction of each flavour ---------------------------------------------


def in_transaction(conn: psycopg.Connection[Any],
                   schema: str) -> Callable[[Statement | CallHook | CallHooks], Any]:
    """Execute a ``HookStep``'s instructions on ``conn``, in its open transaction: a
    statement answers its rows; a hook is called with a ``HookTransaction`` and answers
    the follow-ups it created, or raises ``HookRaised`` (see ``_hook_error``); a
    chunk's hooks (``CallHooks``) are called so, their statements in one pipeline."""

    def execute_instruction(instruction: Statement | CallHook | CallHooks) -> Any:
        if isinstance(instruction, Statement):
            if instruction.query in _ROLLBACKS:
                return _rolled_back_to(conn, instruction.query)
            return execute(conn, instruction)
        if isinstance(instruction, CallHooks):
            return _call_hooks(conn, schema, instruction)
        tx = HookTransaction(conn, schema)
        try:
            instruction.fn(tx, instruction.job, instruction.value)
        except Exception as exc:
            _raise_hook_error(exc, conn.closed)
        return tx.created

    return execute_instruction


def in_transaction_async(conn: psycopg.AsyncConnection[Any],
                         schema: str,
                         ) -> Callable[[Statement | CallHook | CallHooks], Awaitable[Any]]:
    """``in_transaction`` on an asyncio connection (the hooks are ``async def``)."""

    async def execute_instruction(instruction: Statement | CallHook | CallHooks) -> Any:
        if isinstance(instruction, Statement):
            if instruction.query in _ROLLBACKS:
                return await _rolled_back_to_async(conn, instruction.query)
            return await execute_async(conn, instruction)
        if isinstance(instruction, CallHooks):
            return await _call_hooks_async(conn, schema, instruction)
        tx = AsyncHookTransaction(conn, schema)
        try:
            await instruction.fn(tx, instruction.job, instruction.value)
        except Exception as exc:
            _raise_hook_error(exc, conn.closed)
        return tx.created

    return execute_instruction


def _call_hooks(conn: psycopg.Connection[Any], schema: str,
                instruction: CallHooks) -> dict[int, Exception]:
    """``CallHooks`` on a blocking connection."""
    refused: dict[int, Exception] = {}
    adopt = instruction.adopt
    with collection_paused():
        try:
            with conn.pipeline() as pipeline:
                sent = _sent_together(pipeline)
                for at, call in enumerate(instruction.calls):
                    before = sent()
                    tx = HookTransaction(conn, schema)
                    try:
                        call.fn(tx, call.job, call.value)
                    except Exception as exc:
                        clean = _raised_clean(exc, before, sent(), conn.closed)
                        if clean and instruction.tolerant:
                            refused[at] = exc
                            continue
                        _raise_hook_error(exc, conn.closed, at, clean=clean)
                    if tx.created and adopt is not None:
                        conn.execute(adopt, {"parent": call.job.key, "ids": tx.created})
                conn.execute("SELECT 1")  # refused if a hook left the transaction aborted
                for command in instruction.then:
                    conn.execute(command)
        except HookRaised:
            raise
        except Exception as exc:  # at the wait: a statement's, or the connection's
            _raise_hook_error(exc, conn.closed)
    return refused


async def _call_hooks_async(conn: psycopg.AsyncConnection[Any], schema: str,
                            instruction: CallHooks) -> dict[int, Exception]:
    """``CallHooks`` on an asyncio connection (the hooks are ``async def``)."""
    refused: dict[int, Exception] = {}
    adopt = instruction.adopt
    with collection_paused():
        try:
            async with conn.pipeline() as pipeline:
                sent = _sent_together(pipeline)
                for at, call in enumerate(instruction.calls):
                    before = sent()
                    tx = AsyncHookTransaction(conn, schema)
                    try:
                        await call.fn(tx, call.job, call.value)
                    except Exception as exc:
                        clean = _raised_clean(exc, before, sent(), conn.closed)
                        if clean and instruction.tolerant:
                            refused[at] = exc
                            continue
                        _raise_hook_error(exc, conn.closed, at, clean=clean)
                    if tx.created and adopt is not None:
                        await conn.execute(adopt, {"parent": call.job.key, "ids": tx.created})
                await conn.execute("SELECT 1")
                for command in instruction.then:
                    await conn.execute(command)
        except HookRaised:
            raise
        except Exception as exc:
            _raise_hook_error(exc, conn.closed)
    return refused


def _raised_clean(exc: Exception, before: int | None, after: int | None,
                  closed: bool) -> bool:
    """Whether a hook that raised ``exc`` left nothing in the transaction: it sent no
    statement (the pipeline's count of commands did not move, and is known), the error
    is not a database's (which may be an earlier statement's, surfacing), and the
    connection is up."""
    return (before is not None and before == after and not closed
            and not isinstance(exc, psycopg.Error))


def _rolled_back_to(conn: psycopg.Connection[Any], query: str) -> list[Any]:
    """Run one of our ``ROLLBACK TO SAVEPOINT`` (``_ROLLBACKS``) as psycopg runs its own
    transaction commands, past its cache of prepared statements: run as a statement,
    its "ROLLBACK" tag makes psycopg drop every statement it prepared (in case the
    rollback undid a table the plans name), and after each hook that raised the chunk's
    status changes were planned anew for the next five runs, about a millisecond each
    (measured: most of the time of the raising drain). What a hook created and rolled
    back here, a later statement naming it fails, as without a cache."""
    command = getattr(conn, "_exec_command", None)
    if command is None:  # another psycopg: a statement, as any
        return execute(conn, Statement(query, {}))
    conn.wait(command(query))
    return []


async def _rolled_back_to_async(conn: psycopg.AsyncConnection[Any], query: str) -> list[Any]:
    """``_rolled_back_to`` on an asyncio connection."""
    command = getattr(conn, "_exec_command", None)
    if command is None:
        return await execute_async(conn, Statement(query, {}))
    await conn.wait(command(query))
    return []


SENT_TOGETHER = 32
"""A chunk's hooks' statements go to the server this many at a time (``_sent_together``):
one write and one look for answers for them all, and the server at work on them while
the next hooks are called."""


class _CountedQueue(deque[Any]):
    """psycopg's queue of a pipeline's commands to send, counting every command put in
    it (a statement, a transaction command, a sync): ``_sent_together``'s count."""

    def __init__(self, commands: deque[Any]) -> None:
        super().__init__(commands)
        self.queued = 0

    def append(self, command: Any) -> None:
        self.queued += 1
        super().append(command)


def _unknown() -> None:
    return None


def _sent_together(pipeline: Any) -> Callable[[], int | None]:
    """Send the statements executed in ``pipeline`` (psycopg's, either flavour) to the
    server ``SENT_TOGETHER`` at a time, and whenever an answer is waited for (a cursor's
    rows, a nested pipeline's sync, the pipeline's end). psycopg sends each statement as
    it is executed, a poll and a write each (and on a thread the interpreter's lock
    given up and taken back each time, waiting for the dispatcher's other threads):
    held back, a chunk's hooks' statements are put in libpq's buffer and written
    together. The order of the statements, their answers and errors are psycopg's own:
    only when they are written moves. Answers a count of the commands queued in the
    pipeline so far, which tells whether a hook sent anything. On a psycopg whose
    pipeline lacks what this relies on (its queue of statements to send and its two
    generators), nothing is changed and the count is unknown (None)."""
    commands = getattr(pipeline, "command_queue", None)
    communicate = getattr(pipeline, "_communicate_gen", None)
    fetch = getattr(pipeline, "_fetch_gen", None)
    if not isinstance(commands, deque) or not callable(communicate) or not callable(fetch):
        return _unknown
    queue = pipeline.command_queue = _CountedQueue(commands)

    def sent() -> Generator[Any, Any, None]:
        while queue:  # into libpq's buffer: written by the one flush that follows
            queue.popleft()()
        yield from communicate()  # the flush, and the answers already in

    def held_back() -> Generator[Any, Any, None]:
        if len(queue) >= SENT_TOGETHER:
            yield from sent()

    def sent_then_fetched(*, flush: bool) -> Generator[Any, Any, Any]:
        try:
            yield from sent()  # everything held back, then what it waits for
        except BaseException:
            # An error among the answers that came while sending: the others are still
            # collected (else the pipeline could not end), the first error raised.
            with contextlib.suppress(Exception):
                yield from fetch(flush=flush)
            raise
        return (yield from fetch(flush=flush))

    pipeline._communicate_gen = held_back
    pipeline._fetch_gen = sent_then_fetched

    def queued() -> int:
        return queue.queued

    return queued


def _raise_hook_error(exc: Exception, closed: bool, at: int | None = None, *,
                      clean: bool = False) -> NoReturn:
    """Raise what ``exc``, raised by a hook (the ``at``-th of ``CallHooks``), is for
    the step (``_hook_error``)."""
    error = _hook_error(exc, closed, at, clean=clean)
    if error is exc:
        raise exc
    raise error from exc


def _hook_error(exc: Exception, closed: bool, at: int | None = None, *,
                clean: bool = False) -> Exception:
    """What a hook's exception is for the step: ``HookRaised``; or, when the connection
    went down with it, a lost connection (retried as one, never blamed on the hook)."""
    if not closed:
        return HookRaised(exc, at, clean=clean)
    if isinstance(exc, CONNECTION_ERRORS):
        return exc
    return psycopg.OperationalError(
        f"the connection was lost while a hook ran (it raised {type(exc).__name__})")


def with_hooks(step: HookStep[Any], conn: Connection | AsyncConnection,
               schema: str) -> Transaction:
    """The loop instruction that drives ``step`` in one transaction of ``conn``, its
    hooks called in that transaction (``in_transaction``, ``in_transaction_async``)."""
    return Transaction(step, conn, partial(in_transaction, schema=schema),
                       partial(in_transaction_async, schema=schema))


def writing_hooked(hooked: HookedOutcomes, conn: Connection | AsyncConnection,
                   items: list[Hooked]) -> Program[None]:
    """Write ``items`` in one transaction (``fast``), and if a hook raised, ``careful``
    in a new one; a program of ``runtime``. On an asyncio connection (``AsyncDispatcher``)
    the async hooks' items are written so, and the sync hooks' items by this very
    program driven on a thread with a blocking connection of their own."""
    if isinstance(conn, AsyncConnection):
        awaited = [i for i in items if i.is_async]
        plain = [i for i in items if not i.is_async]
        if awaited:
            yield from _hooked_transactions(hooked, conn, awaited)
        if plain:
            if hooked.sync_conn is None:
                settings = hooked.settings
                hooked.sync_conn = Connection(lambda role: connect(settings, role), "recorder")
            yield Blocking(drive, writing_hooked(hooked, hooked.sync_conn, plain))
        return
    yield from _hooked_transactions(hooked, conn, items)


def _hooked_transactions(hooked: HookedOutcomes, conn: Connection | AsyncConnection,
                         items: list[Hooked]) -> Program[None]:
    schema = hooked.settings.schema
    try:
        try:
            written = yield with_hooks(hooked.fast(items), conn, schema)
        except _HOOK_TROUBLE as exc:
            if isinstance(exc, CONNECTION_ERRORS) or conn.lost:
                raise
            culprit = hooked.calling if isinstance(exc, HookRaised) else None
            written = yield with_hooks(hooked.mended(items, culprit), conn, schema)
    except CONNECTION_ERRORS:
        if conn.lost:
            yield Call(conn.discard)
        raise
    conn.succeeded()
    hooked.applied(items, written)


def close_quietly(hooked: HookedOutcomes | None) -> None:
    """Discard the hooked path's own connection, if any (end of a run)."""
    if hooked is not None:
        with contextlib.suppress(Exception):
            hooked.close()


def _refused_singly(hooked: HookedOutcomes, item: Hooked, exc: Exception) -> None:
    """An item that cannot be written even alone: left to its lease (the rescuer retries
    it, counting the attempt), as the batched path does."""
    hooked.recorder.state.drop(item.held, exc)
    hooked.items.remove(item)
    log.error("job %s (key %s): outcome could not be recorded (%s); the lease will expire "
              "and the job be retried", item.held.job.id, item.held.job.key,
              getattr(exc, "sqlstate", None) or type(exc).__name__)


def flush_hooked(hooked: HookedOutcomes, conn: Connection | AsyncConnection,
                 beat: Callable[[], Program[None]]) -> Program[None]:
    """Write every hooked outcome held, in chunks (``HookedOutcomes.next_chunk``), each its
    own transaction; after a chunk is refused for a reason other than a lost connection,
    its outcomes one per transaction, so one bad row cannot block the rest. ``beat`` (the
    recorder's heartbeat, sent when due) runs before each of these transactions, so the
    leases held outlive a write of any length. A part of the recorder's loop (a program
    of ``runtime``): each transaction is ``writing_hooked``.

    Only database errors are handled: anything else (a bug of ours) ends the recorder,
    and the run raises ``DispatcherFailed``. What is held is dropped first, so every
    attempt still reaches the observer. A lost connection (or a cancellation) propagates
    with what is not written yet still held, for the caller to retry.
    """
    try:
        while hooked.items:
            yield from beat()
            chunk, started = hooked.next_chunk(), time.monotonic()
            try:
                yield from writing_hooked(hooked, conn, chunk)
                hooked.took(len(chunk), time.monotonic() - started)
                continue
            except CONNECTION_ERRORS:
                raise
            except psycopg.Error as exc:
                _chunk_refused(exc)
            for item in _still_held(hooked, chunk):
                yield from beat()
                try:
                    yield from writing_hooked(hooked, conn, [item])
                except CONNECTION_ERRORS:
                    raise
                except psycopg.Error as exc:
                    _refused_singly(hooked, item, exc)
    except (*CONNECTION_ERRORS, asyncio.CancelledError):
        raise
    except BaseException as exc:
        _drop_all(hooked, exc)
        raise


def _chunk_refused(exc: psycopg.Error) -> None:
    log.error("recording hooked outcomes failed (%s); recording one by one",
              exc.sqlstate or type(exc).__name__)


def _still_held(hooked: HookedOutcomes, chunk: list[Hooked]) -> list[Hooked]:
    """The items of a refused ``chunk`` not written yet: with ``AsyncDispatcher`` its
    async hooks' transaction may have committed before its sync hooks' was refused."""
    held = set(map(id, hooked.items))
    return [item for item in chunk if id(item) in held]


def _drop_all(hooked: HookedOutcomes, exc: BaseException) -> None:
    """The recorder ends on ``exc``: every hooked outcome held is given up to its lease."""
    items, hooked.items = hooked.items, []
    for item in items:
        hooked.recorder.state.drop(item.held, exc)
