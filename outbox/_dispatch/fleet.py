"""The fleet: one dispatcher serving many targets (``outbox.targets``) within a connection
budget.

Each target has an engine: an ordinary dispatcher of the caller's flavour and options,
bound to the target's DSN and schema, run in turns (``run_until_idle`` with a time
limit). Every guarantee of a dispatcher therefore holds per target as it does alone:
claims, fencing, the ledger row in the target's own database in the same transaction,
limits (counted in each target's database), flows, reconciliation, retention.

    targets   the list given, or the callable's answer re-read every targets_interval:
              a new target is served from then on; a removed one is let go once its
              turn has recorded what it held
    scouts    one thread per database, up to the budget: a connection that LISTENs on
              the channel of every target schema in it (an enqueue makes that target due
              at once) and, every poll interval, asks each idle target whether it has
              work (one small query), but only those where something may have changed
              since it last asked: a turn since, the time its last look gave (a job's
              run_at, a backoff, a lease, an awake mark's end), or that look older than
              ``quiet_look_interval`` (``looks.must_ask``). Databases past the
              budget share one scout, and are polled only: its looks take their
              connection from the turns' pool (either flavour's: an
              ``AsyncDispatcher``'s looks run on its loop) and give it
              back for the turn they wake, or as the first to go; a polled target's
              chores turn starts from its look. Each round it first reads each server's
              counters on one kept connection, and skips the databases that show
              nothing new since their last look (``looks``), each still looked at every
              ``quiet_look_interval``
    turns     at most ``slots`` engines run at once (each holds ENGINE_CONNECTIONS, or
              one more when an effect reconciles); a due target waits for a free slot,
              the least recently served first, and a turn lasts at most TURN seconds: a
              target's backlog delays another target by about one turn. Every target
              gets a turn at least every CHORES_EVERY seconds, due or not, for its
              rescue of expired leases and its retention
    sharing   a turn's parts run on the fleet's long-lived threads and its connections
              come from the fleet's pool and go back to it (``crew``): a turn of a
              target whose database another turn used starts no thread and opens no
              connection. The pool holds at most the budget less the listening scouts',
              idle connections included, the least recently used let go first. Each
              target's schema is checked at its first turn only. ``Dispatcher``'s
              engines are handed the crew and the pool (``_share``); an
              ``AsyncDispatcher``'s turn, a task, sees them in ``crew.turn_share`` (an
              ``AsyncPool`` of its loop, the crew for its sync effects' threads)
    isolation a turn or a look that fails marks its target down: one log line, the
              observer's target_state (metric outbox_target_up{target}), then retried
              with backoff (RETRY_FIRST seconds doubling to RETRY_MAX); the other
              targets go on. No target's failure stops the fleet.

The scheduling decisions are in ``Schedule`` (no I/O, under one lock); what a run does
is ``Fleet._steps`` (read the targets, start the chosen turns, wait), carried out on
threads by ``Fleet.run`` (``Dispatcher``) and as tasks of one loop by
``Fleet.run_async`` (``AsyncDispatcher``), with the same schedule, scouts and turn
(``Fleet._turn``). A run is started once: checked and set under one lock.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from functools import partial
from typing import Any, TypeVar

import psycopg
from psycopg import sql

from .._enqueue import notify_channel
from .._pg import configuration_error, is_pooled, unreachable
from .._steps import Step, execute, execute_async, run, run_async
from ..errors import ConfigurationError, DispatcherFailed, SchemaError
from ..targets import Target
from .connection import connect, connect_async
from .counting import DispatchStats
from .crew import AsyncPool, Crew, Key, Pool, Share, Started, start_thread, turn_share
from .looks import (
    Asked,
    Due,
    Looked,
    Seen,
    ServerRows,
    ask,
    asked_after,
    look,
    must_ask,
    must_look,
    read_counters,
    seen_after,
    server_key,
)
from .network import network_options
from .settings import Settings

__all__ = ["CHORES_EVERY", "ENGINE_CONNECTIONS", "QUIET_LOOK_EVERY", "TURN", "Fleet",
           "Schedule"]

log = logging.getLogger("outbox.dispatcher")

TURN = 2.0  # seconds a target's turn lasts at most
CHORES_EVERY = 60.0  # every target gets a turn this often, due or not (rescue, retention)
ENGINE_CONNECTIONS = 2  # a turn's claimer and recorder (one more when an effect reconciles)
RETRY_FIRST = 1.0  # seconds before a failed target is tried again, doubling ...
RETRY_MAX = 60.0  # ... up to this
QUIET_LOOK_EVERY = 30.0  # a polled database is looked at this often, counters still or not

T = TypeVar("T")

TargetsSource = Sequence[Target] | Callable[[], Sequence[Target]]

def read_targets(source: TargetsSource) -> list[Target]:
    """The targets ``source`` gives now, checked: ``Target`` values, each once."""
    given = source() if callable(source) else source
    if isinstance(given, str | bytes) or not isinstance(given, Iterable):
        raise ConfigurationError(
            f"targets must be a list of outbox.Target (or a callable returning one), "
            f"got {type(given).__name__}")
    found: dict[Target, None] = {}
    for target in given:
        if not isinstance(target, Target):
            raise ConfigurationError(f"targets must hold outbox.Target values, got {target!r}")
        found[target] = None
    return list(found)


@dataclass
class TargetState:
    """What the fleet knows of one target."""

    target: Target
    engine: Any  # a Dispatcher or AsyncDispatcher bound to the target
    due: bool = True  # a first turn at once
    active: bool = False
    removed: bool = False
    up: bool | None = None  # None: not tried yet
    failures: int = 0
    retry_at: float = 0.0
    last_turn: float = 0.0  # monotonic end of its last turn (0: never)
    error: str = ""
    # Its database is past the budget's look-outs: the shared scout's look, which holds
    # a connection to it, also starts its chores turn (``Scout.check``).
    polled: bool = False


@dataclass
class Schedule:
    """Which targets get a turn, and what a turn's end says. No I/O; call under
    ``lock``."""

    max_connections: int
    engine_connections: int
    observer: Any
    states: dict[Target, TargetState] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    scout_connections: int = 0  # reserved for the scouts
    listening: int = 0  # of which the persistent (listening) ones

    @property
    def slots(self) -> int:
        """How many turns may run at once within the budget (at least one)."""
        free = self.max_connections - self.scout_connections
        return max(1, free // self.engine_connections)

    def active(self) -> int:
        return sum(1 for s in self.states.values() if s.active)

    def next_turns(self, now: float, *, until_idle: bool) -> list[TargetState]:
        """The targets to start a turn for now: due (or owed their chores), not failing,
        least recently served first, as many as the free slots."""
        free = self.slots - self.active()
        if free <= 0:
            return []
        waiting = [s for s in self.states.values()
                   if not s.active and not s.removed and s.retry_at <= now
                   and (s.due or (not until_idle and not s.polled
                                  and now - s.last_turn >= CHORES_EVERY))]
        waiting.sort(key=lambda s: s.last_turn)
        chosen = waiting[:free]
        for state in chosen:
            state.active = True
        return chosen

    def fresh_run(self) -> None:
        """A run starts: every target is looked at once more, whatever the last run
        found (a target idle then may have work now; one failing then is tried again)."""
        with self.lock:
            for state in self.states.values():
                state.due, state.failures, state.retry_at = True, 0, 0.0

    def others_waiting(self) -> bool:
        """Whether a due target waits for a slot (a turn then ends at TURN)."""
        return any(s.due and not s.active and not s.removed for s in self.states.values())

    def ended(self, state: TargetState, now: float, *, finished: bool,
              error: BaseException | None) -> None:
        """A turn of ``state`` ended: idle (``finished``), cut at TURN, or failed."""
        state.active = False
        state.last_turn = now
        if error is None:
            state.due = not finished
            state.failures = 0
            state.retry_at = 0.0
            self.mark(state, up=True)
            return
        state.failures += 1
        state.retry_at = now + min(RETRY_MAX, RETRY_FIRST * 2 ** (state.failures - 1))
        state.due = True
        self.mark(state, up=False, error=error)

    def mark(self, state: TargetState, *, up: bool, error: BaseException | str | None = None,
             ) -> None:
        """Note whether ``state``'s target is up; log and tell the observer on a change."""
        text = "" if error is None else describe_failure(error, state.target)
        if up == state.up:  # logged at each change only, not at each retry
            state.error = text
            return
        state.up, state.error = up, text
        name = state.target.name
        if up:
            log.info("target %s is served", name)
        else:
            log.warning("target %s failed (%s); the other targets go on, and it is retried "
                        "with backoff", name, text)
        try:
            self.observer.target_state(name, up)
        except Exception:
            log.exception("observer failed on target_state; ignored")


def describe_failure(error: BaseException | str, target: Target) -> str:
    """One line saying why a target failed, never its password."""
    if isinstance(error, str):
        return error
    if isinstance(error, psycopg.Error):
        fatal = configuration_error(error, target.dsn, doing="serve the target")
        if fatal is not None:
            return str(fatal)
        return f"unreachable: {unreachable(error, target.dsn)}"
    if isinstance(error, ConfigurationError | SchemaError | DispatcherFailed):
        return str(error).splitlines()[0] if str(error) else type(error).__name__
    return type(error).__name__


def add_stats(total: DispatchStats, turn: DispatchStats) -> None:
    """Add one turn's counters into ``total``."""
    for f in fields(DispatchStats):
        if f.name == "claim_seconds_max":
            total.claim_seconds_max = max(total.claim_seconds_max, turn.claim_seconds_max)
        else:
            setattr(total, f.name, getattr(total, f.name) + getattr(turn, f.name))


@dataclass
class Turn:
    """What a turn returned: its counters (None until it returns)."""

    stats: DispatchStats | None = None


@dataclass(frozen=True)
class Refresh:
    """A run's step: read the targets again (``scouting``: and place the scouts)."""

    scouting: bool


@dataclass(frozen=True)
class Turns:
    """A run's step: start a turn of each of ``states``."""

    states: list[TargetState]


@dataclass(frozen=True)
class Wait:
    """A run's step: wait for a wake-up, at most ``seconds``."""

    seconds: float


RunStep = Refresh | Turns | Wait


class Gone(Exception):
    """``AsyncDispatcher``'s loop ended before a look it was given could run."""


async def on_async_pool(pool: AsyncPool, key: Key, others: list[Key], settings: Settings,
                        step: Step[T], recent: Callable[[T], bool]) -> tuple[T, bool]:
    """``Scout.on_pool`` on ``AsyncDispatcher``'s pool, in its loop."""
    conn = await pool.take(key, partial(connect_async, settings, "claimer"), *others)
    finished = False
    try:
        result = await run_async(step, partial(execute_async, conn))
        finished = True
    finally:
        await pool.give(conn, recent=finished and recent(result))
    return result, is_pooled(conn)


class Scout:
    """The look-out of some databases: a due check of each idle target every poll
    interval. ``persistent`` (one database): keeps its connection and LISTENs on its
    targets' channels, so an enqueue wakes its target at once; else (the databases past
    the connection budget) one connection at a time, from the turns' pool, and only for
    the databases whose servers' counters show something new (``poll``)."""

    def __init__(self, fleet: Fleet, dsns: frozenset[str], label: str, *,
                 persistent: bool) -> None:
        # Keyed by connection string, not by database: two targets of one database
        # reached as different roles are looked at each with its own role's rights.
        self.fleet = fleet
        self.dsns = dsns
        self.label = label  # for logs: a database's name, never its connection string
        self.persistent = persistent
        self.stopping = threading.Event()
        self.conn: psycopg.Connection[Any] | None = None
        self.listening: set[str] = set()
        # A listening look-out's last look at each of its schemas, since their LISTEN
        # on the current connection (``looks.must_ask``).
        self.asked: dict[Target, Asked] = {}
        self.thread = threading.Thread(target=self.run, name=f"outbox-scout-{label}",
                                       daemon=True)

    def targets(self) -> list[TargetState]:
        with self.fleet.schedule.lock:
            return self.targets_unlocked()

    def run(self) -> None:
        failures = 0
        while not self.stopping.is_set():
            try:
                self.look()
                failures = 0
            except Gone:
                break
            except psycopg.Error as exc:
                self.close()
                failures += 1
                with self.fleet.schedule.lock:
                    for state in self.targets_unlocked():
                        if not state.active:
                            self.fleet.schedule.mark(state, up=False, error=exc)
                self.stopping.wait(min(RETRY_MAX, RETRY_FIRST * 2 ** (failures - 1)))
            except Exception:
                log.exception("the scout of %s failed unexpectedly; restarting it",
                              self.label)
                self.close()
                self.stopping.wait(RETRY_FIRST)
        self.close()

    def targets_unlocked(self) -> list[TargetState]:
        return [s for s in self.fleet.schedule.states.values()
                if s.target.dsn in self.dsns and not s.removed]

    def look(self) -> None:
        """Listen for a poll interval (or sleep it), then check the idle targets."""
        states = self.targets()
        if not states:
            self.stopping.wait(self.fleet.poll_interval)
            return
        if not self.persistent:
            self.stopping.wait(self.fleet.poll_interval)
            by_dsn: dict[str, list[TargetState]] = {}
            for state in states:
                by_dsn.setdefault(state.target.dsn, []).append(state)
            self.poll(by_dsn)
            return
        conn = self.connect(states[0].target.dsn)
        if not is_pooled(conn):
            self.listen(conn, states)
            # Each notification wakes its target as it arrives; the generator ends when
            # the poll interval is over (or a schema's next look falls due).
            for note in conn.notifies(timeout=self.listen_for(time.monotonic())):
                self.fleet.wake_targets(
                    s for s in states if notify_channel(s.target.schema) == note.channel)
            self.ask_listened(conn, self.targets())
        else:  # no LISTEN through a pooler: every schema asked every poll interval
            self.stopping.wait(self.fleet.poll_interval)
            self.check(conn, self.targets())

    def poll(self, by_dsn: dict[str, list[TargetState]]) -> None:
        """A round of the databases past the budget: each with an idle target is looked
        at, but those its server's counters show quiet since their last look
        (``looks.must_look``), read first on one connection per server."""
        for gone in self.fleet.seen.keys() - by_dsn.keys():  # removed, or listened to now
            self.fleet.seen.pop(gone, None)
        now = time.monotonic()
        idle = {dsn: found for dsn, found in by_dsn.items()
                if not all(s.active or s.due or s.retry_at > now for s in found)}
        counters = self.counters(idle) if self.skipping() else {}
        for dsn, found in idle.items():
            if self.stopping.is_set():
                return
            key = server_key(dsn)
            rows = None if key is None else counters.get(key)
            now = time.monotonic()
            if not self.owes_chores(found, now) and not must_look(
                    self.fleet.seen.get(dsn), rows, now, every=self.fleet.quiet_look_interval):
                self.fleet.skipped += 1
                continue
            try:
                self.look_at(dsn, found, rows)
            except (psycopg.Error, ConfigurationError) as exc:  # this database only
                self.fleet.seen.pop(dsn, None)
                with self.fleet.schedule.lock:
                    for state in found:
                        if not state.active:
                            self.fleet.schedule.mark(state, up=False, error=exc)

    def counters(self, idle: dict[str, list[TargetState]]) -> dict[str, ServerRows]:
        """The counters of every database of each server named among ``idle``, by
        server, read on a connection the pool keeps to any database of it (a database
        whose last look went well first, when one must be opened). A server whose
        counters cannot be read is left out: its databases are looked at."""
        servers: dict[str, list[TargetState]] = {}
        for dsn, found in idle.items():
            key = server_key(dsn)
            if key is not None:
                servers.setdefault(key, []).append(found[0])
        read: dict[str, ServerRows] = {}
        for key, states in servers.items():
            if self.stopping.is_set():
                break
            states.sort(key=lambda s: s.target.dsn not in self.fleet.seen)
            try:
                read[key], _ = self.on_pool(states, read_counters(states[0].target.schema),
                                            recent=lambda _: True)
            except (psycopg.OperationalError, psycopg.InterfaceError,
                    psycopg.errors.InsufficientPrivilege, ConfigurationError) as exc:
                log.debug("the counters of %s could not be read (%s); its databases are "
                          "looked at", states[0].target.database, type(exc).__name__)
        self.fleet.counter_reads += len(read)
        return read

    def owes_chores(self, found: list[TargetState], now: float) -> bool:
        """Whether an idle polled target of ``found`` is owed its chores turn (its look
        starts it)."""
        return any(s.polled and now - s.last_turn >= CHORES_EVERY and not s.active
                   and not s.due and s.retry_at <= now for s in found)

    def skipping(self) -> bool:
        return self.fleet.skip_quiet and self.sharing()

    def sharing(self) -> bool:
        """Whether looks take their connections from the turns' pool (either flavour's)."""
        return self.fleet.share_looks and (
            self.fleet.pool is not None
            or (self.fleet.async_pool is not None and self.fleet.loop is not None))

    def look_at(self, dsn: str, found: list[TargetState], rows: ServerRows | None) -> None:
        """One database past the budget, polled: its targets asked on a claimer
        connection of the fleet's pool (the turns' pool of either flavour), a kept one
        when there is one. Given back as recently used when a target is due (its turn
        takes it next), else as the first to go: the pool keeps the connections of the
        databases with recent work. What it found is remembered against ``rows``, the
        counters read before it (``looks.seen_after``). Without a pool, one opened for
        the look."""
        states = self.asking(found)
        if not states:
            return  # nothing to ask: no connection taken
        self.fleet.looks += 1  # one thread: the polling look-out's
        if not self.sharing():
            try:
                self.check(self.connect(dsn), states)
            finally:
                self.close()
            return
        at = time.monotonic()
        schemas = [s.target.schema for s in states]
        looked, pooled = self.on_pool(states, look(schemas, self.fleet.effect_names),
                                      recent=lambda done: done.found_work)
        self.settle(states, looked)
        seen = seen_after(looked, rows, at, pooled=pooled) if len(states) == len(found) else None
        if seen is None:
            self.fleet.seen.pop(dsn, None)
        else:
            self.fleet.seen[dsn] = seen

    def on_pool(self, states: list[TargetState], step: Step[T],
                recent: Callable[[T], bool]) -> tuple[T, bool]:
        """Run ``step`` on a connection of the turns' pool kept for any database of
        ``states`` (else one opened for the first), and give it back (as recently used
        when ``recent`` says so); its result, and whether that connection goes through
        a pooler."""
        settings = states[0].engine.settings
        key, *others = [(s.engine.settings.conninfo, role) for role in ("claimer", "recorder")
                        for s in states]
        pool, async_pool, loop = self.fleet.pool, self.fleet.async_pool, self.fleet.loop
        if pool is None:
            if async_pool is None or loop is None:
                raise Gone  # the run ended under this look
            return self.on_loop(loop, on_async_pool(async_pool, key, others, settings,
                                                    step, recent))
        conn = pool.take(key, partial(connect, settings, "claimer"), *others)
        finished = False
        try:
            result = run(step, partial(execute, conn))
            finished = True
        finally:
            pool.give(conn, recent=finished and recent(result))
        return result, is_pooled(conn)

    def on_loop(self, loop: asyncio.AbstractEventLoop,
                work: Coroutine[Any, Any, tuple[T, bool]]) -> tuple[T, bool]:
        """``work`` run on ``AsyncDispatcher``'s loop, its answer awaited here; ``Gone``
        when the loop ended first."""
        future = asyncio.run_coroutine_threadsafe(work, loop)
        while True:
            try:
                return future.result(timeout=0.5)
            except concurrent.futures.TimeoutError:
                if loop.is_closed() or not loop.is_running():
                    future.cancel()
                    raise Gone from None

    def asking(self, states: list[TargetState]) -> list[TargetState]:
        """Of ``states``, the idle ones to ask, not known due; a polled one owed its
        chores is due without asking, and woken here."""
        now = time.monotonic()
        owed: list[TargetState] = []
        asked: list[TargetState] = []
        for state in states:
            if state.active or state.due or state.retry_at > now:
                continue
            if state.polled and now - state.last_turn >= CHORES_EVERY:
                owed.append(state)
            else:
                asked.append(state)
        if owed:
            self.fleet.wake_targets(owed)
        return asked

    def settle(self, states: list[TargetState], looked: Looked) -> bool:
        """Wake the targets a look found due, mark down the ones it could not read;
        whether one was woken."""
        woken: list[TargetState] = []
        for state in states:
            answer = looked.answers.get(state.target.schema)
            if isinstance(answer, Due):
                if answer.due:
                    woken.append(state)
            elif answer is not None:  # this target's schema is missing or not readable
                with self.fleet.schedule.lock:
                    self.fleet.schedule.mark(state, up=False, error=answer)
        if woken:
            self.fleet.wake_targets(woken)
        return bool(woken)

    def connect(self, dsn: str) -> psycopg.Connection[Any]:
        if self.conn is None or self.conn.closed:
            # Named as the dispatcher's own connections are ("outbox <role> <worker
            # id>"): an operator (or a fault injector) tells whose look-out it is.
            self.conn = psycopg.connect(
                dsn, autocommit=True, **network_options(dsn),
                application_name=f"outbox scout {self.fleet.worker_id}"[:63])
            self.listening = set()
            self.asked = {}  # nothing seen before this connection's LISTENs counts
        return self.conn

    def listen(self, conn: psycopg.Connection[Any], states: list[TargetState]) -> None:
        for state in states:
            channel = notify_channel(state.target.schema)
            if channel not in self.listening:
                conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
                self.listening.add(channel)
                self.asked.pop(state.target, None)  # asked after its LISTEN

    def check(self, conn: psycopg.Connection[Any], states: list[TargetState]) -> bool:
        """Ask each idle target that is not known due whether it has work (a polled one
        owed its chores is due without asking); whether one was woken."""
        asked = self.asking(states)
        if not asked:
            return False
        step = look([s.target.schema for s in asked], self.fleet.effect_names,
                    identify=False)
        return self.settle(asked, run(step, partial(execute, conn)))

    def close(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(psycopg.Error):
                self.conn.close()
            self.conn = None
            self.listening = set()
            self.asked = {}

    def ask_listened(self, conn: psycopg.Connection[Any], states: list[TargetState]) -> None:
        """A listening look-out's round: of the idle targets not known due, ask those
        where something may have changed since their last look (``looks.must_ask``),
        wake those found due, and remember what each answer says."""
        now = time.monotonic()
        here = {s.target for s in states}
        for gone in self.asked.keys() - here:
            del self.asked[gone]
        idle = self.asking(states)
        if not self.fleet.skip_quiet_schemas:  # every idle schema each round, as before
            self.fleet.count_asks(len(idle), 0)
            self.check(conn, idle)
            return
        every = self.fleet.quiet_look_interval
        asked = [s for s in idle if must_ask(
            self.asked.get(s.target), now, last_turn=s.last_turn, every=every)]
        self.fleet.count_asks(len(asked), len(idle) - len(asked))
        if not asked:
            return
        at = time.monotonic()
        looked = run(ask([s.target.schema for s in asked], self.fleet.effect_names),
                     partial(execute, conn))
        self.settle(asked, looked)
        for state in asked:
            remembered = asked_after(looked.answers.get(state.target.schema), at)
            if remembered is None:
                self.asked.pop(state.target, None)
            else:
                self.asked[state.target] = remembered

    def listen_for(self, now: float) -> float:
        """How long to listen before the next round: a poll interval, or less when a
        schema's next look falls due sooner (never a busy loop: at least a hundredth of
        a second)."""
        wait = self.fleet.poll_interval
        for asked in self.asked.values():
            if asked.next_due is not None and asked.next_due > now:
                wait = min(wait, asked.next_due - now)
        return max(0.01, wait)


class Fleet:
    """Serves every target of ``source`` with engines made by ``make_engine``."""

    def __init__(self, source: TargetsSource, make_engine: Callable[[Target], Any], *,
                 settings: Settings, targets_interval: float, max_connections: int,
                 engine_connections: int, quiet_look_interval: float = QUIET_LOOK_EVERY,
                 ) -> None:
        self.source = source
        self.make_engine = make_engine
        self.poll_interval = settings.poll_interval
        self.effect_names = settings.effect_names
        self.worker_id = settings.worker_id
        self.targets_interval = targets_interval
        self.schedule = Schedule(max_connections, engine_connections, settings.observer)
        self.scouts: dict[frozenset[str], Scout] = {}
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.stats = DispatchStats()
        self._stats_lock = threading.Lock()
        self._targets_read_at = 0.0
        self._running = False  # under _control: a run is started once
        self._control = threading.Lock()
        # The threads and connections turns share (``crew``) during a run of
        # ``Dispatcher``'s; ``shared = False`` makes each turn's own (the cost it
        # replaces, for the benchmark that measures the difference).
        self.shared = True
        # ``share_looks = False``: the polling look-out opens a connection of its own
        # per look, apart from the turns' pool (the cost it replaces, for the benchmark).
        self.share_looks = True
        # ``skip_quiet = False``: every polled database is looked at each round, its
        # counters unread (the cost it replaces, for the benchmark and the tests).
        self.skip_quiet = True
        self.quiet_look_interval = quiet_look_interval
        self.seen: dict[str, Seen] = {}  # by connection string: each polled one's last look
        self.looks = 0  # databases looked at by the polling look-out (for the benchmark)
        self.skipped = 0  # ... and not looked at: their counters stood still
        self.counter_reads = 0  # servers whose counters it read
        # ``skip_quiet_schemas = False``: the listening look-outs ask every idle schema
        # each round (the cost it replaces, for the benchmark).
        self.skip_quiet_schemas = True
        self.asks = 0  # schemas the listening look-outs asked (one statement each) ...
        self.asks_skipped = 0  # ... and did not: nothing may have changed there
        self.loop: asyncio.AbstractEventLoop | None = None  # AsyncDispatcher's, in a run
        self.crew: Crew | None = None
        self.pool: Pool | None = None
        self.async_pool: AsyncPool | None = None  # AsyncDispatcher's turns' connections

    @property
    def running(self) -> bool:
        """Whether a run is under way."""
        with self._control:
            return self._running

    @contextlib.contextmanager
    def _running_once(self) -> Iterator[None]:
        """A run, refused while another is under way: checked and set under one lock,
        so of two run() calls racing, one runs and the other raises."""
        with self._control:
            if self._running:
                raise ConfigurationError("this dispatcher is already running")
            self._running = True
        self.stats = DispatchStats()
        try:
            yield
        finally:
            with self._control:
                self.stopping.clear()
                self._running = False

    # -- called from any thread ----------------------------------------------------------

    def count_asks(self, asked: int, skipped: int) -> None:
        """A listening look-out's round asked ``asked`` schemas and skipped ``skipped``."""
        with self._stats_lock:
            self.asks += asked
            self.asks_skipped += skipped

    def stop(self) -> None:
        """Stop: no new turn starts; the turns running finish as a stopped dispatcher
        does (within its stop_timeout)."""
        self.stopping.set()
        with self.schedule.lock:
            for state in self.schedule.states.values():
                if state.active:
                    state.engine.stop()
        self.wake.set()

    def wake_targets(self, states: Iterable[TargetState]) -> None:
        with self.schedule.lock:
            for state in states:
                state.due = True
        self.wake.set()

    # -- targets -------------------------------------------------------------------------

    def refresh(self, *, scouting: bool) -> None:
        """Read the targets again: new ones get an engine (and their database a scout),
        removed ones are let go (at once when idle, else when their turn ends)."""
        self._targets_read_at = time.monotonic()
        try:
            current = read_targets(self.source)
        except ConfigurationError:
            raise
        except Exception as exc:  # the user's callable failed: keep serving what we have
            if not self.schedule.states:
                raise ConfigurationError(
                    f"the targets callable failed: {type(exc).__name__}: {exc}") from exc
            log.error("reading the targets failed (%s: %s); serving the previous list",
                      type(exc).__name__, exc)
            return
        wanted = set(current)
        with self.schedule.lock:
            states = self.schedule.states
            for target, state in list(states.items()):
                if target not in wanted:
                    state.removed = True
                    if state.active:
                        state.engine.stop()  # finishes and records what it holds
                    else:
                        del states[target]
                    log.info("target %s removed; let go", target.name)
            added = [t for t in current if t not in states]
        for target in added:
            engine = self.make_engine(target)  # checks the options: may raise
            with self.schedule.lock:
                self.schedule.states[target] = TargetState(target, engine)
            log.info("target %s added", target.name)
        if scouting:
            self._place_scouts()
        if self.pool is not None:  # the polling look-out may take from it before a turn
            self.pool.capacity = self._turns_share()
        if self.async_pool is not None and self.share_looks:
            self.async_pool.capacity = self._turns_share()

    def _place_scouts(self) -> None:
        """A scout per database with targets: persistent ones while the budget leaves a
        slot for turns, one shared polling scout for the rest."""
        with self.schedule.lock:
            labels = {s.target.dsn: s.target.database for s in self.schedule.states.values()
                      if not s.removed}
        databases = sorted(labels)  # connection strings: one look-out connection each
        # Reserve the scouts' connections first, so turns never push the total past
        # the budget: persistent scouts for at most half of it, and one shared polling
        # scout (one connection at a time) for the databases past that.
        most = max(0, (self.schedule.max_connections - self.schedule.engine_connections) // 2)
        persistent = set(databases[:most])
        shared = len(databases) > len(persistent)
        with self.schedule.lock:
            self.schedule.scout_connections = len(persistent) + (1 if shared else 0)
            self.schedule.listening = len(persistent)
            for state in self.schedule.states.values():
                state.polled = shared and state.target.dsn not in persistent
        wanted = {frozenset([d]): (True, labels[d]) for d in persistent}
        if shared:
            rest = frozenset(d for d in databases if d not in persistent)
            wanted[rest] = (False, f"{len(rest)} databases")
        for key, scout in list(self.scouts.items()):
            if key not in wanted:
                scout.stopping.set()
                del self.scouts[key]
        for key, (is_persistent, label) in wanted.items():
            if key not in self.scouts:
                scout = Scout(self, key, label, persistent=is_persistent)
                self.scouts[key] = scout
                scout.thread.start()

    def _stop_scouts(self) -> None:
        for scout in self.scouts.values():
            scout.stopping.set()
        for scout in self.scouts.values():
            scout.thread.join(5.0)
        self.scouts.clear()

    # -- turns ---------------------------------------------------------------------------

    def _turn_ended(self, state: TargetState, turn: DispatchStats | None,
                    error: BaseException | None, started: float) -> None:
        now = time.monotonic()
        if error is not None:  # its next turn checks its schema again
            state.engine._schema_seen = False
        if turn is not None:
            with self._stats_lock:
                add_stats(self.stats, turn)
        # A turn that ended before its time limit found the target idle.
        finished = error is None and now - started < TURN
        with self.schedule.lock:
            self.schedule.ended(state, now, finished=finished, error=error)
            if state.removed:
                self.schedule.states.pop(state.target, None)
        self.wake.set()

    def _share(self, engine: Any) -> None:
        """Have ``engine`` (a ``Dispatcher``) run its turns on the crew and the pool."""
        crew, pool = self.crew, self.pool
        if crew is None or pool is None or engine._release == pool.give:
            return
        opener = partial(type(engine)._connect, engine)  # its own: opens one

        def take(role: str) -> psycopg.Connection[Any]:
            return pool.take((engine.settings.conninfo, role), lambda: opener(role))

        engine._connect = take
        engine._release = pool.give
        engine._start = crew.start
        engine._severance.start = crew.start
        engine._schema_once = True

    def _start_turn(self, state: TargetState) -> Started:
        name = f"outbox-turn-{state.target.name}"
        if self.crew is None or self.pool is None:
            return start_thread(partial(self._run_turn, state), name)
        self._share(state.engine)
        self.pool.capacity = self._turns_share()
        return self.crew.start(partial(self._run_turn, state), name)

    def _turns_share(self) -> int:
        """The pool's share of the budget: all but the listening look-outs' (which
        may change as targets come). The turns hold at most their slots' connections
        and the polling look-out one more, for a look."""
        with self.schedule.lock:
            return self.schedule.max_connections - self.schedule.listening

    @contextlib.contextmanager
    def _turn(self, state: TargetState) -> Iterator[Turn]:
        """One turn of ``state``'s engine, however it is run: what it returns (or the
        failure it raises, which stops only this target's turn) goes to the schedule."""
        started = time.monotonic()
        turn = Turn()
        try:
            yield turn
        except Exception as exc:  # isolation: a target's failure stops only its turn
            self._turn_ended(state, None, exc, started)
            return
        self._turn_ended(state, turn.stats, None, started)

    def _run_turn(self, state: TargetState) -> None:
        with self._turn(state) as turn:
            turn.stats = state.engine.run_until_idle(timeout=TURN)

    async def _run_turn_async(self, state: TargetState) -> None:
        with self._turn(state) as turn, self._sharing_async(state):
            turn.stats = await state.engine.run_until_idle(timeout=TURN)

    @contextlib.contextmanager
    def _sharing_async(self, state: TargetState) -> Iterator[None]:
        """Have this turn (an ``AsyncDispatcher``'s, run as this task) take its
        connections from the fleet's async pool and its threads from the crew, and
        check its target's schema at its first turn only (``crew.turn_share``)."""
        if self.crew is None or self.async_pool is None:
            yield
            return
        if self.share_looks:  # the polling look-out takes from it too
            self.async_pool.capacity = self._turns_share()
        else:
            with self.schedule.lock:  # the turns' share: the look-outs' apart
                self.async_pool.capacity = (self.schedule.slots
                                            * self.schedule.engine_connections)
        share = Share(self.async_pool, self.crew.start,
                      schema_seen=getattr(state.engine, "_schema_seen", False))
        token = turn_share.set(share)
        try:
            yield
        finally:
            turn_share.reset(token)
            state.engine._schema_seen = share.schema_seen  # a failed turn clears it

    def _idle(self) -> bool:
        """Under run_until_idle: every target served until idle (or failed once)."""
        with self.schedule.lock:
            return all(not s.active and (not s.due or s.failures > 0)
                       for s in self.schedule.states.values())

    # -- a run: one policy (``_steps``), two drivers ---------------------------------------

    def _steps(self, *, until_idle: bool, deadline: float | None) -> Iterator[RunStep]:
        """What a run does, in order, whatever runs the turns: read the targets, start
        the turns the schedule chooses, wait for a wake-up or the clock; until stopped
        (or, ``until_idle``, until each target is idle or ``deadline`` passes)."""
        yield Refresh(scouting=not until_idle)
        self.schedule.fresh_run()
        while not self.stopping.is_set():
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return
            if not until_idle and now - self._targets_read_at >= self.targets_interval:
                yield Refresh(scouting=True)
            with self.schedule.lock:
                chosen = self.schedule.next_turns(now, until_idle=until_idle)
            if chosen:
                yield Turns(chosen)
            if until_idle and not chosen and self._idle():
                return
            yield Wait(self._sleep(now, deadline))

    def run(self, *, until_idle: bool, timeout: float | None) -> DispatchStats:
        """Serve the targets on threads until stopped (or, ``until_idle``, until each
        is idle or ``timeout`` passes)."""
        with self._running_once():
            deadline = None if timeout is None else time.monotonic() + timeout
            threads: list[Started] = []
            if self.shared:
                self.crew, self.pool = Crew("outbox-fleet"), Pool(1)
            try:
                for step in self._steps(until_idle=until_idle, deadline=deadline):
                    if isinstance(step, Refresh):
                        self.refresh(scouting=step.scouting)
                    elif isinstance(step, Turns):
                        threads.extend(self._start_turn(state) for state in step.states)
                        threads = [t for t in threads if t.is_alive()]
                    else:
                        self.wake.wait(step.seconds)
                        self.wake.clear()
            finally:
                self.stop()
                for thread in threads:
                    thread.join()
                self._stop_scouts()
                if self.crew is not None and self.pool is not None:
                    self.crew.close()
                    self.pool.close()
                self.crew = self.pool = None
        return self.stats

    async def run_async(self, *, until_idle: bool,
                        timeout: float | None) -> DispatchStats:  # noqa: ASYNC109
        """``run`` for ``AsyncDispatcher``: the engines' turns are tasks of this loop,
        sharing the fleet's async pool and crew; the scouts are threads (blocking, one
        small query a look)."""
        with self._running_once():
            deadline = None if timeout is None else time.monotonic() + timeout
            tasks: set[asyncio.Task[None]] = set()
            loop = asyncio.get_running_loop()
            wake = asyncio.Event()
            watcher = threading.Thread(target=self._forward_wake, args=(loop, wake),
                                       name="outbox-fleet-wake", daemon=True)
            watcher.start()
            if self.shared:
                self.crew, self.async_pool = Crew("outbox-fleet"), AsyncPool(1)
                self.loop = loop  # the polling look-out's looks run on it, on the pool
            try:
                for step in self._steps(until_idle=until_idle, deadline=deadline):
                    if isinstance(step, Refresh):
                        await asyncio.to_thread(self.refresh, scouting=step.scouting)
                    elif isinstance(step, Turns):
                        for state in step.states:
                            task = asyncio.create_task(self._run_turn_async(state))
                            tasks.add(task)
                            task.add_done_callback(tasks.discard)
                    else:
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(wake.wait(), step.seconds)
                        wake.clear()
            finally:
                self.stop()
                if tasks:
                    await asyncio.gather(*tasks, return_exceptions=True)
                self.stopping.set()  # ends the wake watcher
                await asyncio.to_thread(self._stop_scouts)
                watcher.join(1.0)
                if self.crew is not None and self.async_pool is not None:
                    self.crew.close()
                    await self.async_pool.close()
                self.crew, self.async_pool, self.loop = None, None, None
        return self.stats

    def _sleep(self, now: float, deadline: float | None) -> float:
        """Until the next thing the loop must do by the clock."""
        wait = min(self.poll_interval, self.targets_interval)
        with self.schedule.lock:
            retries = [s.retry_at - now for s in self.schedule.states.values()
                       if s.retry_at > now]
        if retries:
            wait = min(wait, *retries)
        if deadline is not None:
            wait = min(wait, deadline - now)
        return max(0.001, wait)

    def _forward_wake(self, loop: asyncio.AbstractEventLoop, wake: asyncio.Event) -> None:
        """Carry the scouts' wake-ups (a threading.Event) to the loop's event."""
        while not self.stopping.is_set():
            if self.wake.wait(0.25):
                self.wake.clear()
                try:
                    loop.call_soon_threadsafe(wake.set)
                except RuntimeError:  # the loop closed
                    return
