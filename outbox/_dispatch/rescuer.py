"""The rescue of expired leases: read, decided by the lifecycle, applied fenced.

An expired lease is an attempt whose outcome is unknown: its worker died or stalled, and
may have called the provider first. So the rescuer settles it exactly as the recorder
settles a perform that raised ``UnknownOutcome`` (``_lifecycle.expired``): retried with
the same key after the backoff while the window lasts and attempts remain, else
``reconcile``; a claim an operator cancelled ends ``failed`` (``reconcile`` for an effect
that reconciles), and then its ``on_failed`` hook runs, in the transaction of that
fenced write, as after a perform.

One batch is two statements, whatever its size: ``rescue`` reads the expired claims with
the database's clock, and ``settle`` (the recorder's) applies every decision, fenced on
the claim_version read and on the lease still being expired (``expired: true``), so a
heartbeat or an outcome that commits between the two wins. A decision that runs a hook
is written in a transaction of its own with the hook (``RescueHooks``, written by
``rescue_hooks``; rare: an operator's cancel of a job whose worker died).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Generator, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from functools import partial
from typing import Any, TypeVar

from .. import _lifecycle
from .._lifecycle import Decision
from .._sql import Queries
from .._steps import Statement
from ..effect import Job
from ..errors import UnknownOutcome
from .connection import AsyncConnection, Connection, connect
from .flowsql import flow_queries
from .held import read_payload
from .hook_lookup import is_async_hook
from .hooked import RELEASE, ROLLBACK, SAVEPOINT, HookStep, call_hook, with_hooks
from .reconciler import reconcilers
from .runtime import Blocking, Program, drive
from .settings import Settings
from .settling import as_written, settle_claim, settle_claims

__all__ = [
    "RESCUE_BATCH",
    "RescueHooks",
    "Rescued",
    "Rescuer",
    "rescue_hooks",
]

log = logging.getLogger("outbox.dispatcher")

RESCUE_BATCH = 1000
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Rescued:
    """One expired claim and what the lifecycle decided for it."""

    job: Job
    outcome: UnknownOutcome
    rules: _lifecycle.Rules
    decision: Decision
    now: datetime  # the database's clock as the rescue read it
    hook: Any = None  # the effect's on_failed, when the decision is failed and it has one


@dataclass(frozen=True, slots=True)
class RescueHooks:
    """An instruction of the rescue's step: write ``items`` (failed decisions with an
    ``on_failed`` hook) with their hooks, one savepoint each, in one transaction; the
    executor answers the ids written (the fence held)."""

    items: tuple[Rescued, ...]
    schema: str
    settings: Settings
    rng: random.Random

    def step(self, items: tuple[Rescued, ...]) -> HookStep[set[int]]:
        queries, hooks = self.settings.queries, flow_queries(self.schema)
        written: set[int] = set()
        for item in items:
            job = item.job
            yield SAVEPOINT
            rows = yield Statement(queries.settle, {"claims": _claims([(job, item.decision)])})
            if rows:
                error = yield from call_hook(item.hook, job, item.outcome, hooks)
                if error is not None:  # as after a perform: its writes go, then settle
                    yield ROLLBACK
                    retry = _lifecycle.settle(item.outcome, job, item.rules,
                                              now=item.now, rng=self.rng, hook_error=error)
                    log.warning("job %s (key %s): on_failed raised %s after its lease "
                                "expired -> %s", job.id, job.key, type(error).__name__,
                                retry.status)
                    rows = yield Statement(queries.settle,
                                           {"claims": _claims([(job, retry)])})
            yield RELEASE
            if rows:
                written.add(job.id)
        return written


RescueStep = Generator["Statement | RescueHooks", Any, T]
"""The rescue's step: statements on the claimer's connection, and its hooks' writes."""


def _claims(decided: list[tuple[Job, Decision]]) -> str:
    """The JSON claims of ``settle`` for the rescuer's decisions (fenced on the lease)."""
    return settle_claims(settle_claim(job, d, expired=True) for job, d in decided)


class Rescuer:
    """The rescuer's decisions (a part of the claimer: runs on its thread or task)."""

    def __init__(self, settings: Settings, rng: random.Random) -> None:
        self.settings = settings
        self.rng = rng
        self.reconciling = frozenset(reconcilers(settings))

    def rules(self, effect: str) -> _lifecycle.Rules:
        """The rules that settle ``effect``'s attempts, as the recorder reads them; an
        effect this dispatcher does not serve: the dispatcher's window, no reconcile."""
        served = self.settings.effects.get(effect)
        window = (self.settings.window_for(served) if served is not None
                  else self.settings.unknown_outcome_window)
        return _lifecycle.Rules(window=window, backoff=self.settings.backoff,
                                reconciles=effect in self.reconciling)

    def decide(self, rows: list[Any]) -> list[Rescued]:
        """What the lifecycle decides for each expired claim read by ``rescue``."""
        hooks: Mapping[str, Any] = self.settings.failed_hooks
        decided = []
        for row in rows:
            job = Job(id=row.id, effect=row.effect, key=row.key, payload={},
                      attempt=row.attempts, claim_version=row.claim_version,
                      ordering_key=row.ordering_key, max_attempts=row.max_attempts,
                      first_attempted_at=row.first_attempted_at, group=row.group_key,
                      priority=row.priority, scheduled_for=row.scheduled_for)
            rules = self.rules(row.effect)
            outcome = _lifecycle.lease_expired(job, row.claimed_by)
            decision = _lifecycle.expired(job, rules, now=row.now, rng=self.rng,
                                          worker=row.claimed_by, cancelled=row.cancelled)
            hook = hooks.get(row.effect) if decision.status == "failed" else None
            decided.append(Rescued(job, outcome, rules, decision, row.now, hook))
        return decided

    def rescue(self, queries: Queries) -> RescueStep[list[Rescued]]:
        """One batch: read the expired claims, decide, apply; what was applied (a claim
        whose fence did not hold, because its heartbeat or outcome came first, is not)."""
        rows = yield Statement(queries.rescue, {"limit": RESCUE_BATCH}, named=True)
        if not rows:
            return []
        decided = self.decide(rows)
        plain = [r for r in decided if r.hook is None]
        written: dict[int, Rescued] = {}
        if plain:
            claims = [settle_claim(r.job, r.decision, expired=True) for r in plain]
            sent = {r.job.id: (r, claim) for r, claim in zip(plain, claims, strict=True)}
            settled = yield Statement(queries.settle, {"claims": settle_claims(claims)})
            for job_id, cancelled in settled:
                item, claim = sent[job_id]
                # An operator's cancel that came after the rescue's read: what settle
                # wrote is the cancelled decision, and that is what is logged and waited for.
                written[job_id] = (replace(item, decision=as_written(claim, cancelled=True))
                                   if cancelled else item)
        hooked = [r for r in decided if r.hook is not None]
        if hooked:
            hooked_ids = yield from self._hooked(queries, hooked)
            written.update((r.job.id, r) for r in hooked if r.job.id in hooked_ids)
        return [written[r.job.id] for r in decided if r.job.id in written]

    def _hooked(self, queries: Queries, hooked: list[Rescued]) -> RescueStep[set[int]]:
        """The decisions that run an ``on_failed`` hook: their jobs' payloads, then the
        hooks' transactions."""
        rows = yield Statement(queries.rescued_payloads,
                               {"ids": [r.job.id for r in hooked]}, named=True)
        payloads = {row.id: read_payload(row.payload) for row in rows}
        items = tuple(_with_payload(r, payloads.get(r.job.id, {})) for r in hooked)
        written: set[int] = yield RescueHooks(items, self.settings.schema, self.settings,
                                              self.rng)
        return written


def _with_payload(item: Rescued, payload: Any) -> Rescued:
    job = item.job
    full = Job(id=job.id, effect=job.effect, key=job.key, payload=payload,
               attempt=job.attempt, claim_version=job.claim_version,
               ordering_key=job.ordering_key, max_attempts=job.max_attempts,
               first_attempted_at=job.first_attempted_at, group=job.group,
               priority=job.priority, scheduled_for=job.scheduled_for)
    return Rescued(full, item.outcome, item.rules, item.decision, item.now, item.hook)


def rescue_hooks(instruction: RescueHooks,
                 conn: Connection | AsyncConnection) -> Program[set[int]]:
    """Write ``instruction``'s items with their hooks in one transaction of ``conn`` (the
    claimer's connection); the ids written. A program of ``runtime``: on an asyncio
    connection (``AsyncDispatcher``) the ``async def`` hooks' items are written so, and
    the plain hooks' items by this very program driven on a thread with a blocking
    connection of their own (opened for them, then closed)."""
    items, schema = instruction.items, instruction.schema
    if not isinstance(conn, AsyncConnection):
        written: set[int] = yield with_hooks(instruction.step(items), conn, schema)
        return written
    awaited = tuple(i for i in items if is_async_hook(i.hook))
    plain = tuple(i for i in items if not is_async_hook(i.hook))
    written = set()
    if awaited:
        written |= yield with_hooks(instruction.step(awaited), conn, schema)
    if plain:
        own = Connection(partial(connect, instruction.settings), "claimer")
        try:
            written |= yield Blocking(drive, rescue_hooks(replace(instruction, items=plain),
                                                          own))
        finally:
            yield Blocking(own.discard)
    return written
