"""The scheduler: enqueues the due slots of the schedules (``outbox.Schedule``).

A part of every dispatcher (a thread of ``Dispatcher``, a task of ``AsyncDispatcher``;
under ``run_until_idle`` one pass on the claimer's connection before claiming), so that
stored schedules run without any schedule declared in code. Each pass::

    declare    (first pass of a run) upsert the schedules declared in code
    round      one transaction: the due schedules (next_slot <= now, not paused; the
               partial index schedules_due, so 10,000 schedules cost only the due ones)
               locked FOR UPDATE SKIP LOCKED, so one dispatcher at a time does a
               schedule; for each, the slots its catch-up policy keeps (``Schedule.plan``)
               enqueued through the core's enqueue with the slot's key (the key's dedup
               is the safety net: a slot is never enqueued twice), stamped with
               ``scheduled_for``, and the schedule's next slot advanced, all committed
               together
    wait       until the next slot is due, at most ``TICK`` (a schedule stored meanwhile
               is picked up within it); the pass begins with that probe, so an idle pass
               is one statement on the index, and no transaction

The decisions are steps (``outbox._steps``), written once, and the loop once as a program
(``scheduling``), run on a thread or as a task as the other parts are (``serving``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import psycopg

from .._enqueue import EnqueueResult, PreparedJob, enqueue_many_steps, enqueue_steps, prepare
from .._schedule_store import declare, schedule_queries
from .._steps import Statement, Step
from ..errors import ConfigurationError, EnqueueError
from ..schedules import MAX_CATCH_UP, Schedule, slot_key
from .connection import CONNECTION_ERRORS, AsyncConnection, Connection
from .runtime import Call, Program, Run, Transaction, Wait
from .settings import Settings
from .state import SharedState

__all__ = ["Scheduler", "check_schedules", "schedule_pass", "scheduling"]

log = logging.getLogger("outbox.schedules")

BATCH = 100  # due schedules per transaction
MAX_BATCHES = 100  # per pass: 10,000 schedules due at once are done in one pass
TICK = 1.0  # seconds, at most, between two passes
# After a pass that enqueued, at least this long before the next: slots still due then are
# held by another dispatcher's round (SKIP LOCKED), not worth asking for in a tight loop.
RECHECK = 0.05
LATE = 0.005  # seconds after a slot that the pass wakes (the slot is then surely due)
BROKEN_RETRY = timedelta(minutes=1)  # a definition that cannot be read is looked at again
MAX_PARSED = 50_000  # definitions kept checked (then forgotten all at once)
PRIVILEGE_RETRY = 60.0  # seconds: a grant is looked for again this often


def check_schedules(schedules: object, effects: Sequence[str]) -> tuple[Schedule, ...]:
    """``schedules=`` checked: a list of ``outbox.Schedule`` with distinct names. A
    schedule of an effect this dispatcher does not run is warned about (enqueued all the
    same: a dispatcher that runs the effect performs it)."""
    if schedules is None:
        return ()
    if isinstance(schedules, Schedule | str | bytes) or not isinstance(schedules, Sequence):
        raise ConfigurationError(f"schedules must be a list of outbox.Schedule, got "
                                 f"{type(schedules).__name__}")
    seen: set[str] = set()
    for schedule in schedules:
        if not isinstance(schedule, Schedule):
            raise ConfigurationError(f"schedules holds a {type(schedule).__name__}, not an "
                                     "outbox.Schedule")
        if schedule.name in seen:
            raise ConfigurationError(f"two schedules are named {schedule.name!r}")
        seen.add(schedule.name)
        if schedule.effect not in effects:
            log.warning("schedule %r enqueues effect %r, which this dispatcher does not run "
                        "(its effects: %s): its jobs wait for a dispatcher that does",
                        schedule.name, schedule.effect, ", ".join(sorted(effects)))
    return tuple(schedules)


@dataclass(frozen=True, slots=True)
class Due:
    """A schedule whose next slot is due, locked for this round (``schedule_due``)."""

    name: str
    definition: str
    next_slot: datetime
    at: datetime


class Scheduler:
    """The scheduler's decisions. Runs on one thread (or task) only."""

    def __init__(self, settings: Settings, state: SharedState[Any],
                 declared: Sequence[Schedule],
                 clock: Callable[[], datetime] | None = None) -> None:
        self.settings = settings
        self.state = state
        self.declared = tuple(declared)
        # The time the rounds go by: the database's (None), or a test's clock.
        self.clock = clock
        self.queries = schedule_queries(settings.schema)
        self.declared_done = False
        self.enqueued = 0  # slots enqueued by this scheduler (for tests and logs)
        self.refused = False  # the role may not use the schedules table (said once)
        self.parsed: dict[tuple[str, str], Schedule] = {}  # (name, definition) -> checked

    def declare(self) -> Step[None]:
        """Upsert the schedules declared in code (once per run)."""
        if not self.declared_done:
            yield from declare(self.declared, self.settings.schema, self._now())
            self.declared_done = True

    def _now(self) -> datetime | None:
        return None if self.clock is None else self.clock()

    def round(self) -> Step[bool]:
        """One transaction's work: the due schedules' slots; whether more may be due."""
        rows: list[Due] = yield Statement(self.queries.schedule_due, {
            "now": self._now(), "limit": BATCH}, row=Due)
        if not rows:
            return False
        advanced: dict[str, Advanced] = {}
        wanted: list[tuple[str, datetime, PreparedJob]] = []
        for due in rows:
            advanced[due.name] = self._plan(due, wanted)
        results = yield from self._enqueue([job for *_, job in wanted])
        stamps = []
        for (name, slot, _job), result in zip(wanted, results, strict=True):
            state = advanced[name]
            if isinstance(result, EnqueueError):
                # The slot's key already holds another request (another release's
                # definition enqueued it): not enqueued, said once.
                state.error = f"slot {slot.isoformat()}: {result}"[:500]
                log.error("schedule %r: %s", name, state.error)
                continue
            state.job_id = result.job_id if result.job_id is not None else state.job_id
            if result.created:
                stamps.append({"id": result.job_id, "at": slot.isoformat()})
        if stamps:
            yield Statement(self.queries.schedule_stamp, {"stamps": json.dumps(stamps)})
            self.enqueued += len(stamps)
        yield Statement(self.queries.schedule_advance, {"advanced": json.dumps(
            [state.as_json() for state in advanced.values()])})
        return len(rows) == BATCH

    def wait(self) -> Step[float]:
        """Seconds until the next slot is due (0: one is due now), at most ``TICK``: one
        probe of the index, so an idle pass costs one statement and no transaction."""
        [(seconds,)] = yield Statement(self.queries.schedule_wait, {"now": self._now()})
        if seconds is None:
            return TICK
        return 0.0 if seconds <= 0 else min(TICK, float(seconds) + LATE)

    def _plan(self, due: Due, wanted: list[tuple[str, datetime, PreparedJob]]) -> Advanced:
        """The slots of ``due`` to enqueue (added to ``wanted``, prepared) and its state
        after the round."""
        try:
            schedule = self._schedule(due)
        except (ConfigurationError, ValueError, TypeError) as exc:
            log.error("schedule %r: its stored definition cannot be used (%s); looked at "
                      "again in a minute", due.name, exc)
            return Advanced(due.name, due.at + BROKEN_RETRY,
                            error=f"definition refused: {exc}"[:500])
        plan = schedule.plan(due.next_slot, due.at)
        if plan.skipped or plan.more_skipped:
            log.warning("schedule %r: %s%d missed slot(s) skipped (catch_up=%r%s)", due.name,
                        "at least " if plan.more_skipped else "", plan.skipped,
                        schedule.catch_up,
                        f", at most {MAX_CATCH_UP} caught up" if schedule.catch_up == "all"
                        else "")
        state = Advanced(due.name, plan.next_slot, plan.slots[-1] if plan.slots else None)
        payload = json.loads(schedule.payload_json)
        for slot in plan.slots:
            try:
                job = prepare(schedule.effect, slot_key(due.name, slot), payload,
                              group=schedule.group, priority=schedule.priority)
            except EnqueueError as exc:  # refused by the registry (outbox.register_effects)
                state.error = f"slot {slot.isoformat()}: {exc}"[:500]
                log.error("schedule %r: %s", due.name, state.error)
                continue
            wanted.append((due.name, slot, job))
        return state

    def _schedule(self, due: Due) -> Schedule:
        """The schedule ``due`` defines, parsed and checked once per definition and not
        at each of its slots (it is a good part of a round's time in Python)."""
        found = self.parsed.get((due.name, due.definition))
        if found is None:
            if len(self.parsed) >= MAX_PARSED:
                self.parsed.clear()
            found = Schedule.from_definition(due.name, json.loads(due.definition))
            self.parsed[(due.name, due.definition)] = found
        return found

    def _enqueue(self, jobs: list[PreparedJob]) -> Step[list[EnqueueResult | EnqueueError]]:
        """Each job through the core's enqueue, in one statement; when a key holds another
        request (the batch refused whole), one at a time after rolling the batch back."""
        if not jobs:
            return []
        yield Statement("SAVEPOINT outbox_schedules", {})
        try:
            results: list[EnqueueResult | EnqueueError] = list(
                (yield from enqueue_many_steps(jobs, self.settings.queries)))
        except EnqueueError:
            yield Statement("ROLLBACK TO SAVEPOINT outbox_schedules", {})
            results = []
            for job in jobs:
                try:
                    results.append((yield from enqueue_steps(job, self.settings.queries)))
                except EnqueueError as exc:
                    results.append(exc)
        return results


@dataclass(slots=True)
class Advanced:
    """A schedule's state after a round (``schedule_advance``)."""

    name: str
    next_slot: datetime
    last_slot: datetime | None = None
    job_id: int | None = None
    error: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "next_slot": self.next_slot.isoformat(),
                "last_slot": None if self.last_slot is None else self.last_slot.isoformat(),
                "job_id": self.job_id, "error": self.error}


# -- drivers -----------------------------------------------------------------------------------


def schedule_pass(scheduler: Scheduler, conn: Connection | AsyncConnection) -> Program[float]:
    """One pass (each round its own transaction); the seconds until the next one is
    worth making."""
    yield Run(scheduler.declare(), conn)
    for _ in range(MAX_BATCHES):
        wait: float = yield Run(scheduler.wait(), conn)
        if wait > 0 or scheduler.state.stopping.is_set():
            return wait
        if not (yield Transaction(scheduler.round(), conn)):
            break
    conn.succeeded()
    wait = yield Run(scheduler.wait(), conn)
    return max(RECHECK, wait)


def scheduling(scheduler: Scheduler, conn: Connection | AsyncConnection, *,
               once: bool) -> Program[None]:
    """The scheduler's loop until the dispatcher stops; ``once``: one pass. A database
    error is logged and the pass tried again after a backoff: a bad schedule never stops
    the dispatcher."""
    state = scheduler.state
    try:
        while True:
            try:
                wait = yield from schedule_pass(scheduler, conn)
            except psycopg.Error as exc:
                if conn.lost:
                    yield Call(conn.discard)
                wait = _failed_pass(scheduler, exc, once) or conn.backoff()
            if once or (yield Wait(state.stopping, wait)):
                return
    finally:
        if not once:
            yield Call(conn.discard)


def _failed_pass(scheduler: Scheduler, exc: psycopg.Error, once: bool) -> float | None:
    """Log a failed pass; the seconds to wait before the next one (None: a backoff)."""
    if isinstance(exc, psycopg.errors.InsufficientPrivilege):
        # The dispatcher still claims and performs: only the schedules wait. Said once a
        # process, with the fix.
        if not scheduler.refused:
            scheduler.refused = True
            log.warning("scheduler: the dispatcher's role may not use the schedules table "
                        "(%s): no schedule is enqueued by this dispatcher; grant it SELECT, "
                        "INSERT, UPDATE on <schema>.schedules", str(exc).splitlines()[0])
        return PRIVILEGE_RETRY
    if isinstance(exc, CONNECTION_ERRORS):
        log.warning("scheduler: database unreachable (%s); retrying", type(exc).__name__)
    else:
        log.error("scheduler: a pass failed (%s: %s); retrying", type(exc).__name__,
                  str(exc).strip().splitlines()[0] if str(exc).strip() else "")
    if once:
        log.warning("scheduler: the due slots are enqueued by the next pass")
    return None

