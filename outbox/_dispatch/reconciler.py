"""The reconciler: asks the provider about jobs in ``reconcile``, and writes the answer.

A dispatcher runs it when one of its effects defines ``reconcile`` (a part of its own: a
thread of ``Dispatcher``, a task of ``AsyncDispatcher``; under ``run_until_idle`` one
pass before claiming). Each pass::

    take       one short statement: due jobs in reconcile, claim_version + 1 (the fence of
               the answer), reconcile_at pushed ahead while this dispatcher asks
    ask        effect.reconcile(job), outside any transaction, never on the claimer's
               connection: claims are never held up by a provider
    resolve    one transaction per job, fenced on the version taken, audited as actor
               'reconciler':
                 Performed(result)  reconcile -> done + ledger row + on_done (savepoint;
                                    if the hook raises: pending, the answer kept)
                 NotPerformed()     reconcile -> pending, same key, fresh window
                 Permanent raised   reconcile -> failed + on_failed
                 None               asked again later, with backoff; after
                                    _lifecycle.MAX_UNKNOWN_PASSES answers of None, left to
                                    a person
                 anything else      the provider could not be reached: asked again,
                 raised             the pass not counted toward giving up

How a reply is read (``read_reply``), where an answer sends the job
(``_lifecycle.settle_answer``) and the resolutions (``resolve``, a step that yields statements
and hook calls) are written once, and the loop that runs the passes once as a program
(``reconciling``, see ``runtime``), run on a thread or as a task (``serving``).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import random
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from .. import _lifecycle
from .._steps import Statement, Step
from ..effect import Effect, Job
from ..errors import ConfigurationError, Permanent
from ..flows import NotPerformed, Performed
from .connection import CONNECTION_ERRORS, AsyncConnection, Connection
from .flowsql import flow_queries
from .hook_lookup import is_async_hook, overrides
from .hooked import (
    ROLLBACK,
    SAVEPOINT,
    HookStep,
    call_hook,
    with_hooks,
)
from .runtime import Blocking, Call, Flavoured, Program, Run, Wait, drive
from .settings import Settings
from .standby import ReadOnlyServer
from .state import SharedState
from .workers import result_json

__all__ = ["Answer", "Reconciler", "read_reply", "reconcile_pass", "reconciling", "resolving"]

log = logging.getLogger("outbox.reconciler")

BATCH = 100  # jobs taken per statement
MAX_BATCHES = 10  # per pass: a large backlog is worked through over several passes


@dataclass(frozen=True, slots=True)
class Answer:
    """What the provider said about one job (or that it could not be asked)."""

    job: Job
    checks: int  # passes answered "still unknown" before this one
    kind: _lifecycle.Answered
    result_json: str = "null"
    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class Taken:
    """A job in ``reconcile`` the reconciler took to ask about (``reconcile_take``)."""

    id: int
    effect: str
    key: str
    payload: dict[str, Any]
    attempts: int
    claim_version: int
    ordering_key: str | None
    max_attempts: int
    first_attempted_at: datetime | None
    reconcile_checks: int
    created_at: datetime
    group_key: str | None
    priority: int
    cancelled: bool = False  # an operator cancelled it while it ran

    def job(self) -> Job:
        """The job as ``reconcile`` is given it (its window from the first attempt, or
        from its creation when none is recorded)."""
        return Job(id=self.id, effect=self.effect, key=self.key, payload=self.payload,
                   attempt=self.attempts, claim_version=self.claim_version,
                   ordering_key=self.ordering_key, max_attempts=self.max_attempts,
                   first_attempted_at=self.first_attempted_at or self.created_at,
                   group=self.group_key, priority=self.priority)


def read_reply(job: Job, checks: int, reply: object, error: BaseException | None) -> Answer:
    """The answer a ``reconcile`` call gave: its return value, or what it raised."""
    if isinstance(error, Permanent):
        return Answer(job, checks, "failed", error=error)
    if error is not None:
        return Answer(job, checks, "unreachable", error=error)
    if isinstance(reply, Performed):
        return Answer(job, checks, "performed", result_json=result_json(job, reply.result))
    if isinstance(reply, NotPerformed):
        return Answer(job, checks, "not_performed")
    if reply is None:
        return Answer(job, checks, "unknown")
    problem = TypeError(f"reconcile() of {job.effect!r} returned {type(reply).__name__}: "
                        "expected outbox.Performed, outbox.NotPerformed or None")
    return Answer(job, checks, "unreachable", error=problem)


def reconcilers(settings: Settings) -> dict[str, Effect]:
    """The effects of this dispatcher that define ``reconcile``."""
    return {name: effect for name, effect in settings.effects.items()
            if overrides(effect, "reconcile")}


class Reconciler:
    """The reconciler's decisions. Runs on one thread (or task) only."""

    def __init__(self, settings: Settings, state: SharedState[Any]) -> None:
        self.settings = settings
        self.state = state
        self.effects = reconcilers(settings)
        self.queries = flow_queries(settings.schema)
        self.names = "{" + ",".join(json.dumps(n) for n in sorted(self.effects)) + "}"
        # While one dispatcher asks, others leave the job alone this long.
        self.hold = max(settings.lease, 30.0)
        self.rng = random.Random()
        # The jobs taken whose claim an operator cancelled while it ran (id -> the
        # claim_version taken at): their answer of "not performed" ends them failed.
        self.cancelled: dict[int, int] = {}

    # -- take ------------------------------------------------------------------------------

    def take(self) -> Step[list[tuple[Job, int]]]:
        """Take the jobs due to be asked about: each with its checks so far."""
        rows: list[Taken] = yield Statement(self.queries.reconcile_take, {
            "effects": self.names, "limit": BATCH, "hold": self.hold}, row=Taken)
        self.cancelled.update((t.id, t.claim_version) for t in rows if t.cancelled)
        return [(taken.job(), taken.reconcile_checks) for taken in rows]

    # -- ask -------------------------------------------------------------------------------

    def ask(self, job: Job, checks: int) -> Answer:
        """Call the effect's ``reconcile`` (an ``async def`` one on a loop of its own)."""
        method = self.effects[job.effect].reconcile
        try:
            reply = method(job)
            if inspect.isawaitable(reply):
                reply = asyncio.run(_awaited(reply))
        except Exception as exc:
            return read_reply(job, checks, None, exc)
        return read_reply(job, checks, reply, None)

    async def ask_async(self, job: Job, checks: int) -> Answer:
        """``ask`` on ``AsyncDispatcher``'s loop (a plain ``reconcile`` on a thread)."""
        method = self.effects[job.effect].reconcile
        try:
            if inspect.iscoroutinefunction(method):
                reply = await method(job)
            else:
                reply = await asyncio.to_thread(method, job)
        except Exception as exc:
            return read_reply(job, checks, None, exc)
        return read_reply(job, checks, reply, None)

    # -- resolve ---------------------------------------------------------------------------

    def resolve(self, answer: Answer) -> HookStep[str]:
        """Write ``answer`` in the current transaction; the decision taken."""
        job, q = answer.job, self.queries
        fence = {"id": job.id, "version": job.claim_version}
        cancelled = self.cancelled.pop(job.id, None) == job.claim_version
        if answer.kind == "performed":
            decision, rows = yield from self._performed(answer)
        elif answer.kind == "failed":
            decision, rows = yield from self._failed(answer)
        elif answer.kind == "not_performed":
            decision = "not_performed"
            settled = _lifecycle.settle_answer("not_performed", cancelled=cancelled)
            rows = yield Statement(q.reconcile_not_performed, {
                **fence, "status": settled.status, "delay": settled.delay,
                "attempts": settled.attempts, "fresh_window": settled.fresh_window,
                "error": settled.error})
        else:
            settled = _lifecycle.settle_answer(
                answer.kind, error=answer.error, checks=answer.checks,
                interval=self.settings.reconcile_interval, rng=self.rng)
            gave_up = settled.delay == _lifecycle.NEVER
            decision = "gave_up" if gave_up else answer.kind
            rows = yield Statement(q.reconcile_later, {
                **fence, "delay": None if gave_up else settled.delay,
                "answered": answer.kind == "unknown", "error": settled.error})
            if answer.kind == "unreachable":
                log.warning("job %s (key %s): reconcile could not reach the provider (%s)",
                            job.id, job.key, type(answer.error).__name__)
                return "unreachable"  # not a decision: nothing to audit
        yield Statement(q.reconcile_audit, {"id": job.id, "affected": len(rows),
                                            "detail": json.dumps({"decision": decision})})
        log.info("job %s (key %s): reconciled: %s%s", job.id, job.key, decision,
                 "" if rows else " (the job had moved on: nothing changed)")
        return decision if rows else "moved_on"

    def _performed(self, answer: Answer) -> HookStep[tuple[str, list[Any]]]:
        job = answer.job
        fence = {"id": job.id, "version": job.claim_version, "result": answer.result_json}
        hook = self.settings.done_hooks.get(job.effect)
        yield SAVEPOINT
        rows = yield Statement(self.queries.reconcile_done, fence)
        if rows and hook is not None:
            error = yield from call_hook(hook, job, json.loads(answer.result_json),
                                         self.queries)
            if error is not None:
                yield ROLLBACK
                log.warning("job %s (key %s): on_done raised %s after reconciliation; the "
                            "job is retried with the provider's answer kept", job.id,
                            job.key, type(error).__name__)
                settled = _lifecycle.settle_answer("performed", hook_error=error)
                rows = yield Statement(self.queries.reconcile_keep, {
                    **fence, "error": settled.error})
        return "performed", rows

    def _failed(self, answer: Answer) -> HookStep[tuple[str, list[Any]]]:
        job, error = answer.job, answer.error
        assert error is not None
        hook = self.settings.failed_hooks.get(job.effect)
        fence = {"id": job.id, "version": job.claim_version}
        yield SAVEPOINT
        rows = yield Statement(self.queries.reconcile_fail, {
            **fence, "error": _lifecycle.settle_answer("failed", error=error).error})
        if rows and hook is not None:
            hook_error = yield from call_hook(hook, job, error, self.queries)
            if hook_error is not None:  # the failure stands; only the hook's writes go
                yield ROLLBACK
                settled = _lifecycle.settle_answer("failed", error=error, hook_error=hook_error)
                rows = yield Statement(self.queries.reconcile_fail, {
                    **fence, "error": settled.error})
        return "failed", rows

    def sync_hook(self, answer: Answer) -> bool:
        """Whether resolving ``answer`` calls a plain hook (on ``AsyncDispatcher``: on a
        thread, with a blocking connection)."""
        hooks = {"performed": self.settings.done_hooks,
                 "failed": self.settings.failed_hooks}.get(answer.kind, {})
        hook = hooks.get(answer.job.effect)
        return hook is not None and not is_async_hook(hook)


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


# -- drivers -----------------------------------------------------------------------------------


def reconcile_pass(reconciler: Reconciler, conn: Connection | AsyncConnection,
                   blocking: Connection | None = None) -> Program[int]:
    """One pass: take, ask, resolve; how many were asked. ``blocking``: on an asyncio
    connection, the blocking one that plain hooks write on."""
    asked = 0
    for _ in range(MAX_BATCHES):
        taken = yield Run(reconciler.take(), conn)
        for job, checks in taken:
            answer = yield Flavoured(reconciler.ask, reconciler.ask_async, job, checks)
            yield from resolving(reconciler, conn, answer, blocking)
            asked += 1
        if len(taken) < BATCH or reconciler.state.stopping.is_set():
            break
    conn.succeeded()
    return asked


def reconciling(reconciler: Reconciler, conn: Connection | AsyncConnection, *, once: bool,
                blocking: Connection | None = None) -> Program[None]:
    """The reconciler's loop: a pass every ``reconcile_interval`` (the first at once)
    until the dispatcher stops; ``once``: one pass."""
    state = reconciler.state
    interval = reconciler.settings.reconcile_interval
    try:
        while True:
            wait = interval
            try:
                yield from reconcile_pass(reconciler, conn, blocking)
            except CONNECTION_ERRORS as exc:
                if conn.lost:
                    yield Call(conn.discard)
                if not isinstance(exc, ReadOnlyServer):  # a standby: said once
                    log.warning("reconciler: database unreachable (%s); retrying",
                                type(exc).__name__)
                wait = min(interval, conn.backoff())
            except ConfigurationError:
                raise
            if once or (yield Wait(state.stopping, wait)):
                return
    finally:
        if blocking is not None:
            blocking.discard()
        yield Call(conn.discard)


def resolving(reconciler: Reconciler, conn: Connection | AsyncConnection, answer: Answer,
              blocking: Connection | None = None) -> Program[None]:
    """Write ``answer`` in a transaction of its own; on an asyncio connection, one whose
    hook is plain by this very program driven on a thread, with ``blocking``."""
    if isinstance(conn, AsyncConnection) and reconciler.sync_hook(answer):
        assert blocking is not None
        yield Blocking(drive, resolving(reconciler, blocking, answer))
        return
    yield with_hooks(reconciler.resolve(answer), conn, reconciler.settings.schema)
