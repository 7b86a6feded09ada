"""The claimer: claims due jobs in batches, rescues expired leases, applies retention
(done jobs, ledger rows, inbox rows).

The decisions (how many to claim, what each round does next) are written once here as
steps (``outbox._steps``), and the loop that runs the rounds once as a program
(``claiming``, see ``runtime``): ``run_claimer`` drives it on a blocking connection in
``Dispatcher``'s caller's thread, ``run_claimer_async`` on an asyncio connection as a
task of ``AsyncDispatcher``. Before either, ``schema_wait`` checks that the schema is
current.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import psycopg

from .. import _after, tracing
from .._cancelling import CancelSignal
from .._pg import configuration_error, unreachable
from .._steps import Statement, Step
from ..effect import Job
from ..errors import ConfigurationError, SchemaError
from ..migrate import latest_version, require_current
from ..observe import PurgedTable
from .awake import Awake
from .budget import ClaimStep, LimitedClaims
from .collector import collection_paused
from .connection import CONNECTION_ERRORS, AsyncConnection, Connection, connect
from .counting import Waits
from .crew import turn_share
from .held import decode_payload, undecodable
from .presence import Presence
from .rescuer import RescueHooks, Rescuer, rescue_hooks
from .runtime import Blocking, Call, Cut, Flavoured, Program, Run, Wait, drive, drive_async
from .settings import Settings
from .shared import HomeCall
from .standby import ReadOnlyServer
from .state import AsyncState, Held, SharedState, ThreadState, Timer, guarded
from .statistics import FirstStatistics
from .turns import GroupTurns
from .vacuum import QueueVacuum

__all__ = [
    "Claimer",
    "Round",
    "claim_executor",
    "claim_instruction",
    "claiming",
    "run_claimer",
    "run_claimer_async",
    "schema_wait",
    "wait_for_schema",
    "wait_for_schema_async",
]

log = logging.getLogger("outbox.dispatcher")

RETENTION_INTERVAL = 60.0  # at most, between two rounds of retention ...
# ... and a sixth of the shortest retention: rows outlive their retention by at most
# that much (a minute past a 60 s retention would keep twice the rows it says).
RETENTION_SHARE = 6.0
RETENTION_BATCH = 1000
PURGE_BATCHES = 10  # per table and round
# A round that hit PURGE_BATCHES left rows behind: the next one comes this soon instead
# of a RETENTION_INTERVAL later, so retention keeps up with any steady rate (10,000 rows
# a round a second per dispatcher) while one round stays short enough not to starve claims.
RETENTION_CATCH_UP = 1.0
# How often a running dispatcher looks at the schema's version: one migrated past what
# its code knows stops it (the release that migrated it replaces it).
SCHEMA_CHECK_INTERVAL = 10.0
IDLE_RECHECK = 0.05  # run_until_idle: how soon to look again while others hold jobs
RESCUED_GRACE = 5.0  # run_until_idle: how long past its due time a rescued job is waited for

# The columns a claim answers, in order (claim.sql, fragment claim_taken's RETURNING; the
# limited claim's rows start with them too): the rows are read by position.
CLAIMED = ("id", "effect", "key", "payload", "attempts", "claim_version", "ordering_key",
           "max_attempts", "first_attempted_at", "waited", "trace_context",
           "performed_result", "group_key", "priority", "scheduled_for", "after_failed")
_ID, _EFFECT, _GROUP_KEY, _AFTER_FAILED = (CLAIMED.index(name) for name in (
    "id", "effect", "group_key", "after_failed"))


def _job_maker() -> Callable[[tuple[Any, ...]], Job]:
    """``_new_job``, written for ``Job``'s fields as they are (as ``dataclasses`` writes
    an ``__init__``): one statement a slot, no loop. The values up to ``cancelled``
    come in a tuple, in ``Job``'s field order, unpacked at once (a tuple of another
    length is refused: ``ValueError``); a field after it (none today: one added later)
    gets its default."""
    fields = dataclasses.fields(Job)
    given = [f.name for f in fields].index("cancelled") + 1
    scope: dict[str, Any] = {"new_object": object.__new__, "Job": Job}
    body = ["    job = new_object(Job)",
            "    " + "".join(f"v{i}, " for i in range(given)) + "= values"]
    for i, field in enumerate(fields):
        scope[f"set{i}"] = getattr(Job, field.name).__set__  # the slot's own setter
        if i < given:
            body.append(f"    set{i}(job, v{i})")
        else:
            scope[f"default{i}"] = _default_of(field)
            body.append(f"    set{i}(job, default{i}())")
    source = "\n".join(["def new_job(values):", *body, "    return job"])
    exec(compile(source, "<outbox claimer: _new_job>", "exec"), scope)  # noqa: S102
    made: Callable[[tuple[Any, ...]], Job] = scope["new_job"]
    return made


def _default_of(field: dataclasses.Field[Any]) -> Callable[[], Any]:
    if field.default is not dataclasses.MISSING:
        return partial(_same, field.default)
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory
    raise TypeError(f"Job field {field.name!r} after cancelled has no default")


def _same(value: Any) -> Any:
    return value


_new_job = _job_maker()
"""``Job(*values)`` (``values``: its fields up to ``cancelled``, in order), its slots set
directly: a frozen dataclass's ``__init__`` sets each through ``object.__setattr__``
(2.0 against 1.8 µs a job with its signal, measured), and a loop over the slots' setters
costs 0.6 µs a job more than one statement each (1.4 against 0.8, measured). ``Job`` has
no ``__post_init__``."""


@dataclass(frozen=True, slots=True)
class Round:
    """What one round of the claimer got, and what the loop does next: hand ``batch``
    to the workers, then wait ``wait`` seconds for a wake-up (0: go on at once), or
    return when ``idle`` (``run_until_idle`` found nothing left anywhere). ``failure``:
    a statement failed after ``batch`` was held; the loop hands the batch over first,
    then handles the failure as that of a failed round."""

    batch: list[Held]
    wait: float = 0.0
    idle: bool = False
    failure: psycopg.Error | None = None


class Claimer:
    """The claimer's decisions. Runs on one thread (or task) only."""

    def __init__(self, settings: Settings, state: SharedState[Any], *, until_idle: bool) -> None:
        self.settings = settings
        self.state = state
        self.until_idle = until_idle
        self.queries = settings.queries
        self.rng = random.Random()
        self.rescue_timer = Timer(settings.rescue_interval)
        self.rescuer = Rescuer(settings, self.rng)
        # The jobs this claimer rescued back to pending and has not claimed since, by id:
        # when each is due (monotonic). run_until_idle waits for them, as it waited for
        # the running jobs they were.
        self.rescued_due: dict[int, float] = {}
        self.retention_timer = Timer(retention_interval(settings))
        # Checked at start (wait_for_schema): the first look is an interval later.
        self.schema_timer = Timer(SCHEMA_CHECK_INTERVAL,
                                  time.monotonic() + SCHEMA_CHECK_INTERVAL)
        self.presence = Presence(settings)
        # A busy run() says so, so enqueues of its effects need not notify (awake.py).
        self.awake = Awake(settings, enabled=not until_idle)
        self.statistics = FirstStatistics(settings)
        # Only a dispatcher that runs for long: run_until_idle (cron, a fleet's turns) ends
        # before a vacuum would pay off, and leaves the tables to autovacuum.
        self.vacuum = QueueVacuum(settings, enabled=not until_idle)
        self.turns = GroupTurns()
        self.limited = LimitedClaims(settings, state.limits, self.turns)
        # Children whose parents settled while they were being enqueued (outbox._after).
        self.sweep = _after.Sweep(settings.schema)

    def round(self) -> ClaimStep[Round]:
        """One round: the chores that are due, a claim, and what to do next."""
        yield from self.chores(time.monotonic())
        # Limited, throttled and paused effects first, each within its budget; then the
        # rest in one claim, which never waits for theirs.
        batch: list[Held] = []
        self.limited.wake_in = None
        # Nothing to ask for when full; and while only a batch's worth of room counts
        # (no effect limited or paused), as little as the core claim waits for.
        free = self.capacity() - len(self.state.held)
        claimed = free > 0 and (self.limited.gated or self.room() > 0)
        if claimed:
            yield from self.limited.refresh()
            batch = yield from self.claim_limited()
            try:
                batch += yield from self.claim()
            except psycopg.Error as exc:
                if not batch:
                    raise
                # The limited jobs are held already. Raised, the error would leave them
                # held with no worker to perform them, their leases kept alive by the
                # heartbeat, and a stop waiting for them without end.
                return Round(batch, failure=exc)
        # Marked awake until now and nothing found: the mark goes, then one more claim
        # before sleeping (awake.py).
        if batch or (claimed and (yield from self.awake.asleep())):
            return (yield from self.claimed(batch))
        if not claimed:  # no room: busy performing, it claims again once there is
            yield from self.awake.busy()
        # A budget that will allow more soon: ask again then, not at the next poll.
        soon = self.limited.wake_in
        if self.state.held:
            return Round(batch, wait=_sooner(self.settings.poll_interval, soon))
        if self.until_idle:
            return (yield from self.until_idle_round(soon))
        return Round(batch, wait=_sooner(
            self.settings.poll_interval * self.rng.uniform(0.5, 1.0), soon))

    def until_idle_round(self, soon: float | None) -> ClaimStep[Round]:
        """``run_until_idle``'s round that claimed nothing and holds nothing: idle, or
        what it still waits for (another worker's running jobs, rescued when their leases
        expire; the jobs it rescued, until their retries are due)."""
        if not (yield from self.has_due_work()):
            rescued = self.rescued_wait(time.monotonic())
            if rescued is not None:  # a job it rescued retries after its backoff
                return Round([], wait=_sooner(rescued, soon))
            # idle, unless the sweep woke children (claimed next round)
            return Round([], idle=not (yield from self.settle_waiting()))
        yield from self.rescue()
        return Round([], wait=_sooner(IDLE_RECHECK, soon))

    def claimed(self, batch: list[Held]) -> Step[Round]:
        """A round that goes on at once: with jobs claimed, the mark that this
        dispatcher is awake (awake.py) kept fresh."""
        if batch:
            try:
                yield from self.awake.busy()
            except psycopg.Error as exc:  # the batch is held: hand it over first
                return Round(batch, failure=exc)
        return Round(batch)

    def chores(self, now: float) -> ClaimStep[None]:
        """What a round does when its timer says so, before it claims: the look at the
        schema's version, the rescue, retention (under run_until_idle too: cron
        deployments never call run()), the heartbeat, the queue tables' first statistics,
        the look for queue tables to vacuum."""
        if self.schema_timer.due(now):
            yield from self.check_schema()
        if self.rescue_timer.due(now):
            yield from self.rescue()
            # fan-in's repair rides along: children whose parents' settlement missed them
            yield from self.sweep.sweep()
        elif self.sweep.behind:  # a walk that stopped at its batch goes on
            yield from self.sweep.sweep()
        if self.retention_timer.due(now):
            behind = yield from self.purge()
            if behind:
                self.retention_timer.again_in(now, RETENTION_CATCH_UP)
        if self.presence.due(now):  # the heartbeat, and warnings for unserved effects
            yield from self.presence.beat()
        if self.statistics.due(now):  # once: the queue tables' first statistics
            yield from self.statistics.analyze()
        if self.vacuum.due(now):  # dead rows reclaimed between autovacuum's visits
            yield from self.vacuum.check()

    def settle_waiting(self) -> Step[int]:
        """A whole walk of the fan-in sweep (run_until_idle, before it says idle: a child
        whose parents settled while it was being enqueued is work left). The children
        woken."""
        self.sweep.restart()
        woken = yield from self.sweep.sweep()
        while self.sweep.behind:
            woken += yield from self.sweep.sweep()
        return woken

    def failed(self, exc: psycopg.Error, *, lost: bool) -> None:
        """A round failed: count a lost connection as a reconnect, log either way; raise
        ``ConfigurationError`` if no retry can help (a privilege or a table is missing)."""
        fatal = configuration_error(exc, doing="dispatch")
        if fatal is not None:
            raise fatal from exc
        if isinstance(exc, ReadOnlyServer):  # a standby: said once, as it was met
            return
        if lost:  # only a broken connection is replaced and counted
            guarded(self.state.events.reconnected, "claimer")
            log.warning("claimer lost its connection (%s: %s); reconnecting",
                        type(exc).__name__, unreachable(exc, self.settings.conninfo))
        else:  # a failed statement, transient (40001, 40P01, 55P03, 57014) or not
            log.error("claimer query failed: %s", exc.sqlstate or type(exc).__name__)

    # -- how much to claim -------------------------------------------------------------

    def room(self) -> int:
        """How many jobs to claim now (0: wait for workers to free a good part)."""
        capacity = self.capacity()
        room = capacity - len(self.state.held)
        # Claim in batches: wait until a good part of a batch is free rather than
        # spending a round trip per finished job, unless nothing at all is held.
        if self.state.held and room < max(1, min(self.settings.batch_size, capacity // 4)):
            return 0
        return min(room, self.settings.batch_size)

    def capacity(self) -> int:
        """Jobs to hold at once: one per worker, plus claimed ones waiting for a worker,
        so workers never idle while the next claim is in flight."""
        concurrency = self.settings.concurrency
        if self.settings.prefetch is not None:
            return concurrency + self.settings.prefetch
        mean = self.state.mean_perform_seconds
        if mean is None:  # nothing measured yet: be modest
            return 2 * concurrency
        one_second_of_work = concurrency / max(mean, 1e-6)
        return concurrency + int(min(self.settings.max_prefetch, max(1.0, one_second_of_work)))

    # -- statements ----------------------------------------------------------------------

    def claim(self) -> Step[list[Held]]:
        limit = self.room()
        if limit <= 0 or not self.limited.any_free:
            return []
        settings = self.settings
        started = time.monotonic()
        # Plain tuples of the columns CLAIMED (their names checked once a claim): no row
        # object a job. The limited claims' named tuples start with the same columns.
        rows = yield Statement(self.queries.claim, {
            "effects": self.limited.free_names, "limit": limit, "lease": settings.lease,
            "worker": settings.worker_id, "after": self.turns.json(),
        }, columns=CLAIMED)
        self.turns.served((row[_EFFECT], row[_GROUP_KEY]) for row in rows)
        return (yield from self._taken(rows, started))

    def claim_limited(self) -> ClaimStep[list[Held]]:
        """The gated effects' jobs, each claimed within its shared budget."""
        if not self.limited.gated:
            return []
        started = time.monotonic()
        # Not held back for a batch to fill (as room() is): a budget allows few at a time.
        # Each gated effect takes a share of the room, and the other effects' claim keeps
        # one: a limit spread over many groups rarely runs out of budget, and claimed
        # first with all the room its backlog held back every other effect (seen in
        # chaos runs: 0 payments claimed in 27 s behind per-group limited email).
        parts = len(self.limited.gated) + (1 if self.limited.any_free else 0)
        free = min(self.capacity() - len(self.state.held), self.settings.batch_size)
        share = max(1, -(-free // parts))
        rows = yield from self.limited.claim(
            lambda: min(share, self.capacity() - len(self.state.held)))
        if not rows:
            return []
        return (yield from self._taken(rows, started))

    def _taken(self, rows: list[Any], started: float) -> Step[list[Held]]:
        """What every claim does with the rows it took (since ``started``): no longer
        waited for as rescued, their parents' results read, held as jobs, and counted."""
        if self.rescued_due:  # a loop over the claim's rows only while some are waited for
            for row in rows:
                self.rescued_due.pop(row[_ID], None)
        parents = yield from self.after_results(rows)
        elapsed = time.monotonic() - started
        with collection_paused():  # thousands of jobs made at once (collector.py)
            batch = self._helds(rows, parents)
            self.state.hold(batch)
        guarded(self.state.events.claimed, elapsed, Waits(rows))
        return batch

    def after_results(self, rows: list[Any]) -> Step[dict[int, dict[str, Any]]]:
        """The parents' results of the claimed jobs that waited on parents, by job id:
        one statement, asked only when the claim took such a job."""
        waited = [row[_ID] for row in rows if row[_AFTER_FAILED] is not None]
        if not waited:
            return {}
        return (yield from _after.results_steps(waited, self.settings.schema))

    def _helds(self, rows: list[Any], parents: dict[int, dict[str, Any]]) -> list[Held]:
        """The claimed rows (tuples, or named tuples, starting with the columns of
        ``CLAIMED``) as ``Held`` jobs. The drain's hottest Python (thousands of jobs a
        claim, on the claimer's thread, which sets the pace of one process): what is the
        same for every row is looked up once, each row is unpacked by position (no row
        object: psycopg's plain tuples), the ``Job`` is made by ``_new_job`` and the
        ``Held`` with positional arguments (0.4 µs a job less than ``Job``'s frozen
        ``__init__`` and ``Held``'s keywords, measured)."""
        traced = tracing.enabled()
        settings = self.settings
        watch, lease, timeouts = self.state.watch, settings.lease, settings.timeouts
        effects, async_names = settings.effects, settings.async_names
        decode, new_job, width = decode_payload, _new_job, len(CLAIMED)
        batch: list[Held] = []
        append = batch.append
        for row in rows:
            (job_id, effect, key, payload, attempts, claim_version, ordering_key,
             max_attempts, first_attempted_at, _, trace_context, performed_result,
             group_key, priority, scheduled_for, _) = row if len(row) == width else row[:width]
            # Inline, not read_payload: a try costs nothing until it catches, a call does.
            try:
                body = decode(payload)[0]
            except (ValueError, RecursionError) as exc:  # failed by prepare, not performed
                body = undecodable(exc)
            job = new_job((job_id, effect, key, body, attempts, claim_version,
                           ordering_key, max_attempts, first_attempted_at, None, group_key,
                           priority, scheduled_for, parents.get(job_id) or {},
                           CancelSignal(watch, lease, timeouts.get(effect))))
            append(Held(job, effects[effect], effect in async_names, False, False, 0.0,
                        traced, trace_context if traced else None, None, performed_result))
        return batch

    def check_schema(self) -> Step[None]:
        """Raise ``SchemaError`` once the schema is migrated past this code's version:
        the dispatcher then stops as it does on ``stop()`` (its jobs in flight finish
        or are left to their leases) and ``run()`` raises it."""
        [version] = yield Statement(self.queries.schema_version, {}, scalar=True)
        latest = latest_version()
        if int(version) > latest:
            raise SchemaError(
                f"schema {self.settings.schema!r} was migrated to version {version}, newer "
                f"than this code knows ({latest}): this dispatcher stops; run the release "
                "that migrated it")

    def has_due_work(self) -> Step[bool]:
        # Effects an operator paused are not waited for: they resume when told to.
        due = yield Statement(self.queries.has_due_work, {"effects": self.limited.due_names},
                              scalar=True)
        return bool(due[0])

    def rescue(self) -> ClaimStep[None]:
        """Settle the expired leases as unknown outcomes (``outbox._dispatch.rescuer``)."""
        rescued = yield from self.rescuer.rescue(self.queries)
        now = time.monotonic()
        for item in rescued:
            job = item.job
            log.warning("rescued job %s (key %s, version %s) after its lease expired: now %s",
                        job.id, job.key, job.claim_version, item.decision.status)
            if item.decision.status == "pending":
                self.rescued_due[job.id] = now + item.decision.delay
        if rescued:
            guarded(self.state.events.rescued, len(rescued))

    def rescued_wait(self, now: float) -> float | None:
        """Seconds to wait for the jobs this claimer rescued to pending and has not claimed
        since (None: none is left to wait for). ``run_until_idle`` waits for them: each
        was running, which it waits for, until its worker was found dead; rescued, it
        retries after the backoff of an unknown outcome, performed in the same call. A
        job not claimed ``RESCUED_GRACE`` seconds past its due time (another dispatcher
        took it, or the database's clock runs behind) is no longer waited for."""
        for job_id, due in list(self.rescued_due.items()):
            if now >= due + RESCUED_GRACE:
                del self.rescued_due[job_id]
        if not self.rescued_due:
            return None
        # A poll interval at most: the loop looks at its deadline (and the stop) between.
        left = min(self.rescued_due.values()) - now
        return max(IDLE_RECHECK, min(left, self.settings.poll_interval))

    def purge(self) -> Step[bool]:
        """Retention: done jobs, ledger rows and inbox rows older than their periods, a
        batch at a time, at most ``PURGE_BATCHES`` batches of each per round. True when
        a table had more to purge than one round takes (retention is behind)."""
        behind = False
        settings, q = self.settings, self.queries
        purges: tuple[tuple[str, PurgedTable, str, float | None], ...] = (
            ("done jobs", "jobs", q.purge_done, settings.retention),
            ("the ledger", "effect_results", q.purge_ledger, settings.ledger_retention),
            ("the inbox", "inbox", q.purge_inbox, settings.inbox_retention))
        for what, table, query, age in purges:
            if age is None:
                continue
            for _ in range(PURGE_BATCHES):  # bounded per round: must not starve claims
                try:
                    rows = yield Statement(query, {"age": age, "limit": RETENTION_BATCH},
                                           count=True)
                except psycopg.errors.InsufficientPrivilege as exc:
                    raise _purge_refused(what, exc, settings) from exc
                [(deleted,)] = rows  # the statement's row count (count=True)
                if deleted > 0:
                    guarded(self.state.events.purged, table, deleted)
                if deleted < RETENTION_BATCH:
                    break
            else:
                behind = True
        return behind


def retention_interval(settings: Settings) -> float:
    """Seconds between two rounds of retention: RETENTION_INTERVAL, or a RETENTION_SHARE
    of the shortest retention when that is less (at least RETENTION_CATCH_UP)."""
    ages = [age for age in (settings.retention, settings.ledger_retention,
                            settings.inbox_retention) if age]
    if not ages:
        return RETENTION_INTERVAL
    return max(RETENTION_CATCH_UP, min(RETENTION_INTERVAL, min(ages) / RETENTION_SHARE))


def _sooner(wait: float, soon: float | None) -> float:
    return wait if soon is None else max(0.001, min(wait, soon))


_RETENTION_OPTION = {"done jobs": "retention", "the ledger": "ledger_retention",
                     "the inbox": "inbox_retention"}


def _purge_refused(what: str, exc: psycopg.Error, settings: Settings) -> ConfigurationError:
    """A purge the role may not run: say which table and how to fix it (the inbox is
    the one a dispatcher's role is most likely not to have been granted)."""
    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    reason = reason.removeprefix("ERROR:").strip()
    return ConfigurationError(
        f"cannot purge {what} ({reason}): grant the dispatcher's role SELECT, UPDATE "
        f"(the purge locks rows) and DELETE there, or turn this retention off with "
        f"{_RETENTION_OPTION[what]}=None")


# -- the loops: written once as programs (``runtime``), ``Dispatcher``'s driven on the
# -- caller's thread, ``AsyncDispatcher``'s as a task -------------------------------------


def schema_wait(
    conn: Connection | AsyncConnection, check: Callable[[], None], settings: Settings,
    state: SharedState[Any], deadline: float | None,
) -> Program[None]:
    """Refuse a missing or newer schema at once; wait for an unreachable database
    (until ``deadline``, when there is one). ``check``: the blocking check (on the
    claimer's connection, or for ``AsyncDispatcher`` on a connection of its own)."""
    while True:
        try:
            yield Blocking(check)
            return
        except CONNECTION_ERRORS as exc:
            yield Call(conn.discard)
            if not _still_waiting(exc, settings, deadline):
                raise
            if (yield Wait(state.stopping, conn.backoff())):
                return


def wait_for_schema(
    conn: Connection, settings: Settings, state: ThreadState, deadline: float | None,
) -> None:
    """``schema_wait`` on the caller's thread, the check on the claimer's connection."""
    drive(schema_wait(conn, lambda: require_current(conn.get(), settings.schema),
                      settings, state, deadline))


async def wait_for_schema_async(
    settings: Settings, state: AsyncState, deadline: float | None,
) -> None:
    """``schema_wait`` for ``AsyncDispatcher``: the same blocking check, once per run,
    on a thread and a connection of its own (in a fleet, at a target's first turn only:
    ``crew.turn_share``)."""
    share = turn_share.get()
    if share is not None and share.schema_seen:
        return
    await drive_async(schema_wait(AsyncConnection(settings, "claimer"),
                                  partial(_check_schema, settings), settings, state,
                                  deadline))
    if share is not None and not state.stopping.is_set():
        share.schema_seen = True


def _check_schema(settings: Settings) -> None:
    with connect(settings, "claimer") as conn:
        require_current(conn, settings.schema)


def _still_waiting(exc: BaseException, settings: Settings, deadline: float | None) -> bool:
    """The database was unreachable for the schema check: False once ``deadline`` has
    passed (the caller gives up), else say so and return True (it tries again)."""
    if deadline is not None and time.monotonic() >= deadline:
        return False
    if isinstance(exc, ReadOnlyServer):  # a standby: said once, as it was met
        return True
    log.warning("cannot reach the database at %s; retrying",
                unreachable(exc, settings.conninfo))
    return True


def claim_instruction(conn: Connection | AsyncConnection,
                      instruction: HomeCall | RescueHooks) -> Any:
    """What the claimer's steps ask for besides statements, as the loop instruction that
    does it: a call to the limits' home as it is (blocking: asyncio runs it on a
    thread), the rescue's hooks in a transaction of the claimer's connection."""
    if isinstance(instruction, HomeCall):
        return Blocking(instruction.fn)
    return Flavoured(drive, drive_async, rescue_hooks(instruction, conn))


def claim_executor(conn: Connection) -> Callable[[Statement | HomeCall | RescueHooks], Any]:
    """How the claimer's steps are run on a blocking connection outside its loop (a
    round alone: ``run(claimer.round(), claim_executor(conn))``)."""
    def execute(instruction: Statement | HomeCall | RescueHooks) -> Any:
        if isinstance(instruction, Statement):
            return conn.execute(instruction)
        return drive(_answer(claim_instruction(conn, instruction)))
    return execute


def _answer(instruction: Any) -> Program[Any]:
    return (yield instruction)


def claiming(
    claimer: Claimer, conn: Connection | AsyncConnection,
    submit: Callable[[list[Held]], None], deadline: float | None,
) -> Program[None]:
    """The claimer's loop, until stopped, idle or ``deadline``: a round, its batch handed
    over, then a wait for a wake-up (or a backoff after a failure)."""
    state = claimer.state
    translate = partial(claim_instruction, conn)
    try:
        while _claiming(state, deadline):
            try:
                result = yield Run(claimer.round(), conn, translate, shielded=True)
            except Cut as cut:  # cancelled (asyncio) while the round ran on to its end
                state.request_stop()  # nothing new starts: what this round claims goes back
                with contextlib.suppress(psycopg.Error):
                    submit((yield cut.rest).batch)
                raise cut.error from None
            except psycopg.Error as exc:
                claimer.failed(exc, lost=conn.lost)
                wait = conn.backoff()
            else:
                submit(result.batch)
                if result.failure is not None:
                    claimer.failed(result.failure, lost=conn.lost)
                    wait = conn.backoff()
                elif result.idle:
                    return
                else:
                    wait = result.wait
            if wait:
                yield Wait(state.wake, wait)
                state.wake.clear()
    finally:
        yield Blocking(claimer.vacuum.close)
        if not conn.lost:  # stopping: say so at once, if the database is there
            with contextlib.suppress(psycopg.Error):
                yield Run(claimer.presence.leave(), conn)
            with contextlib.suppress(psycopg.Error):
                yield Run(claimer.awake.asleep(), conn)  # enqueues notify the others


def run_claimer(
    claimer: Claimer, conn: Connection, submit: Callable[[list[Held]], None],
    deadline: float | None,
) -> None:
    """``claiming`` on the caller's thread (``Dispatcher``)."""
    drive(claiming(claimer, conn, submit, deadline))


async def run_claimer_async(
    claimer: Claimer, conn: AsyncConnection, submit: Callable[[list[Held]], None],
    deadline: float | None,
) -> None:
    """``claiming`` as a task of ``AsyncDispatcher``."""
    await drive_async(claiming(claimer, conn, submit, deadline))


def _claiming(state: SharedState[Any], deadline: float | None) -> bool:
    """Whether the claimer's loop goes on: not stopping, and ``deadline`` not passed."""
    return not state.stopping.is_set() and (deadline is None or time.monotonic() < deadline)
