"""The dispatcher: claim due jobs, perform their effects, record the outcome, fenced.

``Dispatcher`` builds its parts (``outbox._dispatch``), starts them and joins them::

    claimer  (the caller's thread)  claim batches, rescue expired leases, retention
    recorder                        complete / settle batches, heartbeat held leases
    listener                        LISTEN for enqueue notifications, wake the claimer
    workers                         run ``perform`` (threads; async effects on one loop),
                                    at most ``concurrency`` at once across both

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
import difflib
import inspect
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from functools import partial
from types import FrameType
from typing import Any

import psycopg

from ._dispatch.claimer import wait_for_schema, wait_for_schema_async
from ._dispatch.connection import AsyncConnection, Connection, connect
from ._dispatch.counting import DispatchStats
from ._dispatch.crew import Started, start_thread
from ._dispatch.fleet import ENGINE_CONNECTIONS, Fleet, TargetsSource
from ._dispatch.hook_lookup import require_sync_hooks
from ._dispatch.options import (
    ENGINE_OPTIONS,
    OPTIONS,
    PUBLIC_OPTIONS,
    SETTINGS_OPTIONS,
    docstring,
    settings_options,
)
from ._dispatch.reconciler import reconcilers
from ._dispatch.replicas import AsyncReplicaGate, ReplicaGate, check_access, check_access_async
from ._dispatch.runtime import Program, drive, drive_async
from ._dispatch.scheduler import check_schedules
from ._dispatch.serving import serve, serving
from ._dispatch.settings import Settings, text_array
from ._dispatch.severance import Severance
from ._dispatch.shared import held
from ._dispatch.state import (
    AsyncState,
    Held,
    LoopEvent,
    SharedState,
    ThreadState,
    guarded,
)
from ._dispatch.supervision import supervising
from ._dispatch.workers import DaemonPool, TaskWorkers, ThreadWorkers
from ._lifecycle import Backoff
from .effect import Effect
from .errors import ConfigurationError, DispatcherFailed
from .limits import Limit
from .observe import DispatchObserver, MultiObserver
from .schedules import Schedule
from .targets import Target

__all__ = ["AsyncDispatcher", "DispatchStats", "Dispatcher"]

log = logging.getLogger("outbox.dispatcher")

_text_array = text_array  # the claim's effects parameter, for tests that claim by hand

OPTION_NAMES = frozenset(option.name for option in OPTIONS)
SETTINGS_FIELDS = frozenset(f.name for f in dataclasses.fields(Settings))


class _Options:
    """What both dispatchers take: the options, checked once into ``settings``."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # A wrong argument names the class the caller wrote (not this shared base) and,
        # for a misspelt option, the option meant.
        if args or kwargs:  # none: copy or unpickle, which set the state themselves
            _check_arguments(cls, args, kwargs)
        return super().__new__(cls)

    # The checked options, also readable as attributes (``d.lease``, ``d.schema``, ...).
    schema: str
    concurrency: int
    lease: float
    batch_size: int
    prefetch: int | None
    max_prefetch: int
    poll_interval: float
    rescue_interval: float
    backoff: Backoff
    unknown_outcome_window: float
    retention: float | None
    ledger_retention: float | None
    inbox_retention: float | None
    worker_id: str
    reconcile_interval: float
    stop_timeout: float
    wait_for_replicas: bool | tuple[str, ...]

    def __init__(
        self,
        conninfo: str | None = None,
        effects: Sequence[Effect] | None = None,
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
        inbox_retention: float | timedelta | None = timedelta(days=7),
        worker_id: str | None = None,
        listen_conninfo: str | None = None,
        observer: DispatchObserver | None = None,
        metrics: bool = False,
        on_done: Mapping[str, Callable[..., Any]] | None = None,
        on_failed: Mapping[str, Callable[..., Any]] | None = None,
        reconcile_interval: float | timedelta = 60.0,
        limits: Mapping[str, Limit] | None = None,
        breaker_threshold: int | None = 5,
        stop_timeout: float | timedelta = 30.0,
        targets: TargetsSource | None = None,
        targets_interval: float | timedelta = 30.0,
        max_connections: int = 16,
        quiet_look_interval: float | timedelta = 30.0,
        limits_home: Target | str | None = None,
        schedules: Sequence[Schedule] | None = None,
        wait_for_replicas: bool | Sequence[str] = False,
    ) -> None:
        """Check every option now: a wrong one raises ``outbox.ConfigurationError`` here.

        A duration is seconds (a float) or a ``timedelta``, at most a century. The
        parameters are declared, with their text, in ``outbox._dispatch.options.OPTIONS``,
        in this signature's order: their ``:param`` lines (the reference's parameter
        table) are built from it.

        :raises outbox.ConfigurationError: An option that can never work, named.
        """
        # What was given, by option name: one dict every reader takes its share of.
        given = {name: value for name, value in locals().items() if name in OPTION_NAMES}
        if effects is None:
            raise ConfigurationError(f"{type(self).__name__} needs effects=[...], the "
                                     "effects it performs")
        if (conninfo is None) == (targets is None):
            raise ConfigurationError(
                f"{type(self).__name__} takes either a connection string (one database) "
                "or targets=[outbox.Target(dsn, schema), ...] (several), "
                + ("not both" if targets is not None else "and was given neither"))
        if targets is not None and listen_conninfo is not None:
            raise ConfigurationError("listen_conninfo is for one database; with targets, "
                                     "each target's database is listened to directly")
        if metrics:
            from .metrics import with_metrics  # prometheus-client is an optional extra

            given["observer"] = with_metrics(observer or DispatchObserver())
            given["metrics"] = False  # done: a dispatcher made from this one adds none
        self._given = given
        self.settings = Settings.build(conninfo or "", effects, **settings_options(given))
        self._show_options()
        # Recurring effects (outbox.Schedule), upserted when a run starts; the clock the
        # scheduler goes by (None: the database's).
        self.schedules = check_schedules(schedules, list(self.settings.effects))
        self._schedule_clock: Callable[[], Any] | None = None
        self.stats = DispatchStats()
        self._running = False
        self._stop_early = False  # stop() came between runs: the next run stops at once
        # One lock for a run's start and end and for stop(): a run is started once, and a
        # stop() from any thread is seen by the run it races with (see serving.serve).
        self._control = threading.RLock()  # re-entrant: a signal handler may call stop()
        self._fleet: Fleet | None = None
        if targets is not None:
            self._fleet = self._make_fleet(targets, targets_interval, max_connections,
                                           quiet_look_interval)
        self._setup()
        guarded(self.settings.observer.effects_registered, sorted(self.settings.effects))

    @property
    def _engine_options(self) -> dict[str, Any]:
        """The options an engine of the fleet gets, as given (observer, limits, worker id
        and limits home are read from the settings when it is made: ``add_observer``,
        ``add_limits`` and ``outbox run`` change them)."""
        return {name: self._given[name] for name in ENGINE_OPTIONS}

    def _show_options(self) -> None:
        """The checked options as attributes (``d.lease``, ...), from the settings."""
        for name in PUBLIC_OPTIONS:
            setattr(self, name, getattr(self.settings, name))

    def _set_options(self, **changes: Any) -> None:
        """Change options after construction (``outbox run``'s flags), checked as the
        constructor checks them: the settings, the attributes and what the fleet's
        engines get change together. Not during a run."""
        self._refuse_while_running("change options")
        unknown = sorted(set(changes) - (set(SETTINGS_OPTIONS) & SETTINGS_FIELDS))
        if unknown:
            raise ConfigurationError(f"{', '.join(unknown)}: not an option to change here")
        given = {**self._given, **changes}
        checked = Settings.build(self.settings.conninfo, list(self.settings.effects.values()),
                                 **settings_options(given))
        # Every checked value anew (a derived one follows: rescue_interval after lease),
        # but what the dispatcher changed since it was built stays, unless named here.
        kept = {"conninfo", "observer", "limits", "limits_home", "worker_id"} - set(changes)
        self.settings = dataclasses.replace(
            checked, **{name: getattr(self.settings, name) for name in kept})
        self._given = given
        self._show_options()
        self._setup()

    def _setup(self) -> None:
        """What a flavour prepares once, after the options are checked."""

    def _make_fleet(self, targets: TargetsSource, interval: float | timedelta,
                    max_connections: int, quiet_look_interval: float | timedelta = 30.0,
                    ) -> Fleet:
        """The fleet serving ``targets``, each with an engine of this flavour."""
        if not callable(targets) and (isinstance(targets, str | bytes | Target)
                                      or not isinstance(targets, Sequence)):
            raise ConfigurationError(
                "targets must be a list of outbox.Target or a callable returning one, "
                f"got {type(targets).__name__}")
        engine_connections = ENGINE_CONNECTIONS + (1 if reconcilers(self.settings) else 0)
        if (isinstance(max_connections, bool) or not isinstance(max_connections, int)
                or max_connections < engine_connections + 1):
            raise ConfigurationError(
                f"max_connections must be an integer of at least {engine_connections + 1} "
                f"(a look-out connection and one target's turn), got {max_connections!r}")
        seconds = interval.total_seconds() if isinstance(interval, timedelta) else interval
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds <= 0:
            raise ConfigurationError(
                f"targets_interval must be a positive number of seconds, got {interval!r}")
        quiet = (quiet_look_interval.total_seconds()
                 if isinstance(quiet_look_interval, timedelta) else quiet_look_interval)
        if isinstance(quiet, bool) or not isinstance(quiet, int | float) or quiet <= 0:
            raise ConfigurationError("quiet_look_interval must be a positive number of "
                                     f"seconds, got {quiet_look_interval!r}")
        return Fleet(targets, self._engine, settings=self.settings,
                     targets_interval=float(seconds), max_connections=max_connections,
                     engine_connections=engine_connections,
                     quiet_look_interval=float(quiet))

    def _same_options(self) -> dict[str, Any]:
        """This dispatcher's effects and options as keyword arguments, as they stand now
        (``add_observer``, ``add_limits`` and ``outbox run --stop-timeout`` change them
        after it was built): for the dispatchers made from it."""
        # One worker id for the process: the jobs its engines hold say who holds them
        # (claimed_by, outbox status) the same in every target.
        return {"effects": list(self.settings.effects.values()),
                "observer": self.settings.observer, "limits": dict(self.settings.limits),
                **self._engine_options, "stop_timeout": self.settings.stop_timeout,
                "worker_id": self.settings.worker_id,
                "limits_home": self.settings.limits_home}

    def _engine(self, target: Target) -> Any:
        """A dispatcher of this flavour bound to ``target``: the fleet runs its turns."""
        return type(self)(target.dsn, schema=target.schema, **self._same_options())

    def _with_targets(self, targets: TargetsSource, max_connections: int = 16) -> Any:
        """A dispatcher of this flavour with the same effects and options serving
        ``targets`` (``outbox run --target``, ``--targets``)."""
        return type(self)(targets=targets, max_connections=max_connections,
                          quiet_look_interval=self._given["quiet_look_interval"],
                          **self._same_options())

    @property
    def serves_targets(self) -> bool:
        """Whether this dispatcher serves several targets (built with ``targets=``)."""
        return self._fleet is not None

    def add_observer(self, observer: DispatchObserver) -> None:
        """Add ``observer`` beside the dispatcher's own (``observer=``, ``metrics=True``):
        from the next run on, it hears every event they hear. Adding one that is already
        there does nothing. Not during a run: raises ``ConfigurationError``."""
        if not isinstance(observer, DispatchObserver):
            raise ConfigurationError(
                f"observer must be an outbox.observe.DispatchObserver, "
                f"got {type(observer).__name__}")
        self._refuse_while_running("add observers")
        current = self.settings.observer
        present = current.observers if isinstance(current, MultiObserver) else (current,)
        if observer in present:
            return
        combined = (observer if type(current) is DispatchObserver
                    else MultiObserver([*present, observer]))
        self.settings = dataclasses.replace(self.settings, observer=combined)
        self._setup()  # the shared state takes its observer from the settings
        guarded(observer.effects_registered, sorted(self.settings.effects))

    def add_limits(self, limits: Mapping[str, Limit]) -> None:
        """Add provider limits (effect name -> ``outbox.Limit``) to those the dispatcher
        was built with (``limits=``, each effect's declared ``limit``): from the next run
        on, they bound its effects as ``limits=`` does. Where an effect already has a
        limit, the one added here replaces it whole (``outbox run --limit`` uses this
        to override the module's limits). Checked as ``limits=`` is: a name this
        dispatcher does not run, or a value that is not an ``outbox.Limit``, raises
        ``ConfigurationError`` and changes nothing. Call it before the run starts; during
        a run it raises ``ConfigurationError``."""
        self._refuse_while_running("add limits")
        self.settings = self.settings.with_limits(limits)
        self._setup()

    # The state of the run under way (a ``Dispatcher`` keeps one for its life).
    _state: SharedState[Any] | None

    def stop(self) -> None:
        """Ask ``run`` to stop: nothing new is claimed; in-flight work finishes or is
        released (jobs not started go back to ``pending`` with the attempt refunded).

        Safe to call from any thread (or a signal handler), before or during a run, and
        never lost: it takes the lock a run's start and end take, so it reaches the run
        under way, or else the next run, which then returns at once. A run that a stop
        ended leaves nothing behind: the run after it starts afresh."""
        with self._control:
            state = self._state if self._running else None
            if state is None:
                self._stop_early = True
            else:
                state.request_stop()
        if self._fleet is not None:
            self._fleet.stop()

    def _refuse_while_running(self, what: str) -> None:
        if (self._running or getattr(self, "_task", None) is not None
                or (self._fleet is not None and self._fleet.running)):
            raise ConfigurationError(f"{what} before the dispatcher runs, not during")

    def _failed(self, failure: BaseException) -> DispatcherFailed:
        return DispatcherFailed(
            f"the dispatcher stopped: a part of it died of {type(failure).__name__} "
            "(logged); jobs it held are retried once their leases expire"
        )


# The constructors' docstring: its parameter lines from the declared options.
_head, _, _tail = (_Options.__init__.__doc__ or "").partition(":raises")
_Options.__init__.__doc__ = docstring(_head, ":raises" + _tail)


def _check_arguments(cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    signature = inspect.signature(cls.__init__)  # type: ignore[misc]
    try:
        signature.bind(None, *args, **kwargs)
    except TypeError as exc:
        accepted = [name for name in signature.parameters if name != "self"]
        unknown = [name for name in kwargs if name not in signature.parameters]
        if unknown:
            close = difflib.get_close_matches(unknown[0], accepted, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else (
                f" (it takes: {', '.join(accepted)})")
            raise TypeError(f"{cls.__name__}() got an unexpected keyword argument "
                            f"{unknown[0]!r}{hint}") from None
        raise TypeError(f"{cls.__name__}(): {exc}") from None


class Dispatcher(_Options):
    """Claims due jobs, performs their effects outside any transaction, records outcomes.

    Guarantees (with the database as the only source of truth):

    - A job is claimed in a short READ COMMITTED transaction with ``FOR UPDATE SKIP
      LOCKED``; two workers never hold the same job at the same ``claim_version``.
    - ``perform`` runs after the claim committed, outside any transaction, at most
      ``concurrency`` at a time, sync and async effects together (sync ones on
      ``concurrency`` threads, async ones on an event loop of the dispatcher's).
      Delivery to an effect is at least once: a crash or a stall past the lease makes
      the job run again, with the same key.
    - Completion is one statement: the fenced ``running -> done`` update (with
      ``retention=0``, the fenced delete) and the ledger row commit together or not at
      all. A stale worker's writes change nothing.
    - Leases are extended by heartbeats while effects run; a job whose worker died is
      rescued (fenced) once its lease expires, within one ``rescue_interval``.
    - Only jobs whose ``effect`` names one of ``effects`` are claimed; others stay pending.

    ``lease`` is the claim's lifetime in seconds (or a timedelta), at least 1 second.
    ``batch_size`` caps the jobs one claim takes. ``prefetch`` is how many claimed jobs
    may wait for a free worker (their leases are heartbeated too); by default it adapts
    to about one second of work at the measured speed of the effects (up to
    ``max_prefetch``), so fast effects are claimed in large batches while slow ones are
    not hoarded by one process. ``prefetch=0`` claims only what can start at once.

    ``unknown_outcome_window`` (24 hours) is how long after a job's first attempt an
    ``UnknownOutcome`` or an expired lease is retried with the same key before the job
    goes to ``reconcile``; an effect that declares its own
    (``outbox.Effect.unknown_outcome_window``, its provider's idempotency window) has
    its jobs decided by that one instead, whether longer or shorter. The rescuer applies
    this dispatcher's effects' windows to every expired lease it takes back, and its own
    window to jobs of effects it does not run.

    Retention (seconds or a timedelta; None keeps rows forever) runs about once a minute
    under ``run`` and ``run_until_idle`` alike: done jobs are deleted after ``retention``
    (7 days), ledger rows after ``ledger_retention`` (90 days, never shorter than
    ``retention``), inbox rows (``tx.receive``) after ``inbox_retention`` (7 days; a
    message redelivered after its row is gone counts as new). Each runs in batches, a
    bounded number per round, so a large backlog never starves claims. A role without
    SELECT, UPDATE and DELETE on a purged table raises ``outbox.ConfigurationError``
    naming the option that turns that retention off.

    ``retention=0`` (or ``timedelta(0)``) keeps no done rows: completion deletes the job
    instead of marking it done, in the same fenced statement that writes its ledger row
    (a stale claim deletes nothing and writes no ledger row), which drains faster. The
    ledger row then alone keeps the key from being enqueued again; the dashboard and
    ``outbox status`` show no done jobs, only failed and reconcile ones. One window is
    wider than with done rows kept: an enqueue of the same key whose statement (under
    REPEATABLE READ, whose transaction) began before the completion committed does not
    see the ledger row yet and creates the job again.

    ``limits`` (effect name -> ``outbox.Limit``, over each effect's own declared
    ``limit``) bounds how fast and how many at once each effect is performed, counted in
    the database across every dispatcher on the schema: a limited effect's jobs are
    claimed within its budget and on their own, so they never hold back other effects.
    An effect that raises ``outbox.Throttled`` is paused for every dispatcher and its job
    handed back without counting the attempt. ``breaker_threshold`` (5) transient
    failures of an effect in a row (connection errors, timeouts, 5xx: ``Retry``,
    ``UnknownOutcome`` or any other exception) open its breaker: the effect is paused for
    every dispatcher (1 s, doubling at each opening in a row up to 15 s), then one probe
    job tests recovery; jobs waiting meanwhile are not claimed and count no attempt.
    ``None`` turns the breaker off. An operator pauses and resumes an effect with
    ``outbox pause`` / ``outbox resume`` (or the dashboard).

    ``limits_home`` (an ``outbox.Target``, or a connection string for schema ``outbox``)
    is where the limits declared ``Limit(shared=True)`` are counted: one rate for a
    provider account that many targets (tenant databases or schemas) share, held by every
    dispatcher that names the same home. It is an outbox schema migrated to this version;
    each process keeps one connection to it while it runs. Required when a limit is shared.

    ``stop_timeout`` (seconds or a timedelta, 30): a stop always ends. After ``stop()``,
    SIGTERM or SIGINT, performs in flight get this long to finish and be recorded; then
    ``run`` returns anyway. Each job still held is logged (one warning line a job) and
    left to its lease: never marked done, never handed back as if not started (its
    perform may have acted), so another dispatcher performs it again once the lease
    expires (at least once, with the same key). Worker threads are daemon threads: a
    perform that never returns does not keep the process alive, and what it returns
    after the stop is not recorded. Set an orchestrator's grace period (Kubernetes'
    ``terminationGracePeriodSeconds``) above ``stop_timeout`` plus a few seconds.

    ``wait_for_replicas=True``: a claimed job is performed only once every streaming
    physical standby (``wait_for_replicas=["standby1"]``: each of those names, its
    ``application_name``) has flushed the claim's commit (and so the enqueue's), so a
    failover to a standby that lagged never leaves an effect performed for an order the
    new primary lost. Each batch waits at most 30 s (then it is handed back unperformed and
    claimed again); with no standby streaming, jobs are performed at once (said once).
    The role needs ``pg_monitor``: without it, ``ConfigurationError`` at start.
    Connections get ``connect_timeout``, keepalives and ``tcp_user_timeout`` defaults
    (a dead or partitioned server is given up within 8 s) that the connection string's
    own parameters override; a standby reached instead of the primary is said once and
    retried with backoff (list every host with ``target_session_attrs=read-write``).

    ``observer`` (an ``outbox.observe.DispatchObserver``) receives every claim, attempt,
    fence rejection and rescue, for metrics and tracing; an exception it raises is
    logged and ignored. ``metrics=True`` adds the Prometheus metrics of
    ``outbox.metrics.PrometheusObserver`` on prometheus-client's default registry
    (``outbox-pg[prometheus]``; serve them with ``outbox.metrics.serve_metrics``).
    ``listen_conninfo`` is a direct connection string for LISTEN when
    ``conninfo`` goes through a transaction-pooling PgBouncer; a connection found to be
    pooled gets no session ``SET`` and no prepared statements, and without
    ``listen_conninfo`` the dispatcher polls. A configuration that can never work (no
    such database, a wrong password, a missing privilege) raises
    ``outbox.ConfigurationError`` at once; an unreachable server is waited for.

    Flows (``outbox.flows``): an effect's ``on_done`` / ``on_failed`` (or a function given
    here as ``on_done={effect: fn}`` / ``on_failed={...}``, which takes the method's place)
    runs inside the transaction that records the job's outcome; its writes, its follow-up
    jobs, the ledger row and the fenced status change commit together or not at all, each
    job in a savepoint of its own (jobs without hooks keep the batched statements).
    ``Dispatcher`` runs plain hooks only; ``async def`` hooks need ``AsyncDispatcher``.
    Jobs in ``reconcile`` of an effect that defines ``reconcile`` are asked about within
    ``reconcile_interval`` seconds (60), then with backoff.

    ``schedules`` (a list of ``outbox.Schedule``): recurring effects, upserted into the
    schema's schedules table when a run starts (a definition declared here replaces a
    stored one of the same name, with a warning). Every dispatcher, with schedules
    declared or not, enqueues the due slots of every schedule of its schema, stored ones
    included: each slot once, whatever the number of dispatchers (its job key is derived
    from the schedule's name and the slot). See ``outbox.schedules``.

    A part that dies of an unexpected error (the recorder, a worker) stops the
    dispatcher loudly: it is logged and ``run`` / ``run_until_idle`` raise
    ``outbox.DispatcherFailed``; the listener, only a hint, is restarted instead.
    """

    # A fleet's engine (``_dispatch.crew``) runs its parts on the fleet's threads, takes
    # its connections from the fleet's pool and gives them back, and checks its target's
    # schema at its first turn only; a dispatcher run alone makes and closes its own.
    _start: Callable[[Callable[[], object], str], Started] = staticmethod(start_thread)
    _release: Callable[[psycopg.Connection[Any]], None] | None = None
    _schema_once = False
    _schema_seen = False

    _state: ThreadState

    def _setup(self) -> None:
        require_sync_hooks(self.settings.done_hooks, self.settings.failed_hooks)
        # One state for the dispatcher's life (reset between runs).
        self._state = SharedState(self.stats, self.settings.observer,
                                  self.settings.concurrency, threading.Event)
        # Its connections are cut at stop_timeout if the database hangs.
        self._severance = Severance(self.settings.worker_id)

    def _connect(self, role: str) -> psycopg.Connection[Any]:
        """A new connection for ``role`` (claimer, recorder, listener), set up."""
        return connect(self.settings, role)

    # -- public control ------------------------------------------------------------------

    def run_until_idle(self, timeout: float | None = None) -> DispatchStats:
        """Process every job that is due now, then return the counters of this call.

        Returns once no job of this dispatcher's effects is claimable and none is running,
        here or in another worker: a running job held elsewhere is waited for, and
        rescued here if its lease expires (its worker died or froze), then performed
        here once its retry is due (an unknown outcome, retried after the backoff: a job
        rescued here is waited for). Other jobs retried with a delay are not waited for.
        With ``timeout`` (seconds), stops
        claiming when it passes and returns once this dispatcher's in-flight work is
        recorded.

        With ``targets``: every target is served until it is idle (a target that fails is
        logged and left after its first failure), the counters summed over them.
        """
        if self._fleet is not None:
            with held(self.settings.limits_home):
                self.stats = self._fleet.run(until_idle=True, timeout=timeout)
            return self.stats
        return self._serve(until_idle=True, timeout=timeout)

    def run(self) -> DispatchStats:
        """Dispatch until ``stop()``, SIGTERM or SIGINT; then finish in-flight work.

        Wakes on LISTEN/NOTIFY when jobs are enqueued and also polls with jitter.
        Survives connection loss and database restarts: reconnects with backoff. Returns
        within ``stop_timeout`` seconds (plus a moment to close) of the stop, whatever
        the performs in flight do; a ``stop()`` before ``run()`` makes it return at once.
        """
        with self._signals_stop():
            if self._fleet is not None:
                with held(self.settings.limits_home):
                    self.stats = self._fleet.run(until_idle=False, timeout=None)
                return self.stats
            return self._serve(until_idle=False, timeout=None)

    @contextlib.contextmanager
    def _signals_stop(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum: int, frame: FrameType | None) -> None:
            log.info("signal %s: stopping after in-flight work", signum)
            # Not here: the main thread may be inside wake.wait(), holding the lock that
            # stop()'s wake.set() takes; setting it from the handler deadlocks.
            threading.Thread(target=self.stop, name="outbox-stop", daemon=True).start()

        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)

    # -- a run: ``_dispatch.serving`` on the caller's thread, its parts on threads -----------

    def _serve(self, *, until_idle: bool, timeout: float | None) -> DispatchStats:
        deadline = None if timeout is None else time.monotonic() + timeout
        return drive(serve(self, _Threads(self), until_idle=until_idle, deadline=deadline))

    _dispatch = serving  # the parts started, the claimer run, the drain, the parts joined


class _Threads:
    """``Dispatcher``'s way of one run (``serving.Flavour``): its parts on threads of
    their own (a fleet's crew: ``_start``), its connections from ``_connect`` (given
    back to a fleet's pool: ``_release``), its stop watch a thread, its state the
    dispatcher's own for its life (reset between runs, so a stop() before run() is
    honoured)."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher
        self.settings = dispatcher.settings
        self.claimer = self.connection("claimer")
        self._workers = contextlib.ExitStack()

    def begin(self) -> ThreadState:
        dispatcher, settings = self.dispatcher, self.settings
        self.state = state = dispatcher._state
        dispatcher.stats = state.stats = DispatchStats()
        severance = dispatcher._severance
        self.watch = severance.watch(state, settings.stop_timeout, settings.lease,
                                     threading.Event)
        severance.start(partial(drive, self.watch.watching()), "outbox-stop-watch")
        return state

    def prepare(self, state: ThreadState, deadline: float | None) -> None:
        dispatcher = self.dispatcher
        if not dispatcher._schema_seen:
            wait_for_schema(self.claimer, self.settings, state, deadline)
            dispatcher._schema_seen = dispatcher._schema_once
        check_access(self.claimer, self.settings)

    def connection(self, role: str) -> Connection:
        return Connection(self.dispatcher._connect, role, self.dispatcher._release)

    def hooks_apart(self) -> None:
        return None  # a Dispatcher's hooks are plain: its connections run them

    def start(self, part: str, program: Program[None]) -> Started:
        # A thread is never cancelled: whatever ends it is a death.
        return self.dispatcher._start(partial(drive, supervising(self.state, part, program, ())),
                                      THREADS[part])

    def join(self, thread: Started, grace: float | None) -> None:
        _join(thread, grace)

    def end(self, thread: Started, grace: float) -> None:
        _join(thread, grace)  # it ends at the stop it watches

    def workers(self) -> Callable[[list[Held]], None]:
        return self._workers.enter_context(
            ThreadWorkers(self.settings, self.state, self.dispatcher._start).running())

    def gate(self, submit: Callable[[list[Held]], None]) -> Callable[[list[Held]], None]:
        return ReplicaGate(self.settings, self.state, self.claimer, submit)

    def join_workers(self) -> None:
        self._workers.close()  # after stop_timeout: the stuck ones get STUCK_GRACE

    end_workers = join_workers  # a thread cannot be cancelled: told to stop, joined

    def abandons(self, error: BaseException) -> bool:
        return False  # no cancellation: every stop drains

    def close(self) -> None:
        return None

    def returned(self) -> None:
        self.watch.returned()

    def finish(self, state: ThreadState) -> None:
        state.reset()


# The threads of ``Dispatcher``'s parts, by part.
THREADS = {"reconciler": "outbox-reconciler", "scheduler": "outbox-scheduler",
           "recorder": "outbox-recorder", "cancellation watcher": "outbox-cancel-watch",
           "listener": "outbox-listener"}


def _join(thread: Started, seconds: float | None) -> None:
    """Join ``thread``; with ``seconds``, give up after that long (the parts are daemon
    threads: one stuck on a provider or a dead connection does not hold the stop)."""
    thread.join(seconds)
    if thread.is_alive():
        log.warning("dispatcher %s did not end within %gs of the stop; left behind",
                    thread.name, seconds)


class AsyncDispatcher(_Options):
    """``Dispatcher`` on one asyncio event loop: the same options and guarantees.

    - Claims, records and heartbeats run as tasks over psycopg ``AsyncConnection``s,
      with the same statements and decisions as ``Dispatcher`` (one shared core).
    - Async effects run as tasks on the loop; sync effects on a thread pool of at most
      ``concurrency`` threads; at most ``concurrency`` performs at once across both.
    - ``await d.run_until_idle(timeout=None)`` processes every job due now, then
      returns the counters. ``await d.run()`` dispatches until ``d.stop()`` or until
      cancelled; either way in-flight work finishes, and jobs not yet started are handed
      back with their attempt refunded (the first cancellation drains; ``run`` then
      re-raises ``CancelledError``; a second one abandons the rest to the rescuer, which
      takes those jobs back once their leases expire). No signal handlers are installed:
      the application owns them.
    - ``async with d:`` starts ``run()`` in a task and, on exit, stops it and awaits it
      (its errors surface there).

    Delivery to an effect is at least once, as with ``Dispatcher``: a crash or a stall
    past the lease makes the job run again with the same key; fenced writes make a stale
    worker's outcome change nothing.
    """

    def _setup(self) -> None:
        # Its connections are cut at stop_timeout if the database hangs.
        self._severance = Severance(self.settings.worker_id)
        self._state: AsyncState | None = None  # during a run only
        self._task: asyncio.Task[DispatchStats] | None = None

    async def run_until_idle(self, timeout: float | None = None) -> DispatchStats:  # noqa: ASYNC109 - the contract's name
        """Process every job that is due now, then return the counters of this call.

        As ``Dispatcher.run_until_idle``: a job running elsewhere is waited for (and
        rescued if its lease expires); with ``timeout`` (seconds), claiming stops when it
        passes and the call returns once in-flight work is recorded.
        """
        if self._fleet is not None:
            with held(self.settings.limits_home):
                self.stats = await self._fleet.run_async(until_idle=True, timeout=timeout)
            return self.stats
        deadline = None if timeout is None else time.monotonic() + timeout
        return await self._serve(until_idle=True, deadline=deadline)

    async def run(self) -> DispatchStats:
        """Dispatch until ``stop()`` or cancellation; then finish in-flight work.

        Wakes on LISTEN/NOTIFY and polls with jitter; reconnects with backoff after a
        connection loss or a database restart. As with ``Dispatcher``, returns within
        ``stop_timeout`` seconds (plus a moment to close) of the stop: jobs still held
        then are left to their leases and their async performs cancelled.
        """
        if self._fleet is not None:
            with held(self.settings.limits_home):
                self.stats = await self._fleet.run_async(until_idle=False, timeout=None)
            return self.stats
        return await self._serve(until_idle=False, deadline=None)

    async def __aenter__(self) -> AsyncDispatcher:
        if self._task is not None:
            raise ConfigurationError("this AsyncDispatcher is already running")
        self._task = asyncio.get_running_loop().create_task(self.run(), name="outbox-dispatcher")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        self.stop()
        await task

    async def _serve(self, *, until_idle: bool, deadline: float | None) -> DispatchStats:
        return await drive_async(serve(self, _Tasks(self), until_idle=until_idle,
                                       deadline=deadline))

    _dispatch = serving  # the parts started, the claimer run, the drain, the parts joined


class _Tasks:
    """``AsyncDispatcher``'s way of one run (``serving.Flavour``): its parts are tasks
    on the running loop, ended by cancellation; sync effects run on daemon threads; a
    state made for the run (its signals belong to this loop). asyncio's cancellation:
    the first drains; a second (or one during the wind-down) abandons the rest to the
    rescuer, every task cancelled."""

    def __init__(self, dispatcher: AsyncDispatcher) -> None:
        self.dispatcher = dispatcher
        self.settings = dispatcher.settings
        self.claimer = AsyncConnection(self.settings, "claimer")
        self._pool: DaemonPool | None = None
        self._workers: TaskWorkers | None = None
        self._gate: AsyncReplicaGate | None = None

    def begin(self) -> AsyncState:
        dispatcher, settings = self.dispatcher, self.settings
        dispatcher.stats = DispatchStats()
        self.state = state = SharedState(dispatcher.stats, settings.observer,
                                         settings.concurrency, LoopEvent)
        dispatcher._state = state
        # Its connections are cut at stop_timeout if the database hangs.
        self.watch = dispatcher._severance.watch(state, settings.stop_timeout,
                                                 settings.lease, LoopEvent)
        self._watching = asyncio.get_running_loop().create_task(
            drive_async(self.watch.watching()), name="outbox-stop-watch")
        return state

    async def prepare(self, state: AsyncState, deadline: float | None) -> None:
        await wait_for_schema_async(self.settings, state, deadline)
        await check_access_async(self.settings)

    def connection(self, role: str) -> AsyncConnection:
        return AsyncConnection(self.settings, role)

    def hooks_apart(self) -> Connection:
        # Plain hooks write on a thread, with a blocking connection of their own.
        return Connection(partial(connect, self.settings), "reconciler")

    async def start(self, part: str, program: Program[None]) -> asyncio.Task[None]:
        return asyncio.get_running_loop().create_task(
            drive_async(supervising(self.state, part, program)))

    async def join(self, task: asyncio.Task[None], grace: float | None) -> None:
        await asyncio.wait({task}, timeout=grace)
        if not task.done():
            await self.end(task, 0.0)

    async def end(self, task: asyncio.Task[None], grace: float) -> None:
        task.cancel()
        await asyncio.wait({task}, timeout=max(grace, CANCELLED_WITHIN))
        if not task.done():
            log.warning("dispatcher task %s did not end within %gs of its cancellation; "
                        "left behind", task.get_name(), max(grace, CANCELLED_WITHIN))

    def workers(self) -> Callable[[list[Held]], None]:
        # Daemon threads: a sync perform that never returns must not keep the process
        # alive once run() has returned after stop_timeout (ThreadPoolExecutor's threads
        # are joined at interpreter exit).
        if self.settings.has_sync:
            self._pool = DaemonPool(self.settings.concurrency, "outbox-worker")
        self._workers = TaskWorkers(self.state, self._pool)
        return self._workers.submit

    def gate(self, submit: Callable[[list[Held]], None]) -> Callable[[list[Held]], None]:
        self._gate = AsyncReplicaGate(self.settings, self.state, submit)
        return self._gate

    async def join_workers(self) -> None:
        assert self._workers is not None
        if self.state.abandoned:
            # stop_timeout passed: what is still held is left to its lease; async
            # performs are cancelled, sync ones on the pool are left to finish unheard.
            self._workers.cancel()
        await self._workers.join()

    async def end_workers(self) -> None:
        if self._workers is not None:
            await asyncio.gather(*self._workers.cancel(), return_exceptions=True)

    def abandons(self, error: BaseException) -> bool:
        if not isinstance(error, asyncio.CancelledError):
            return False
        current = asyncio.current_task()
        # Cancelled twice already (the second came while the claimer finished its
        # round): abandon, as a second cancellation during the drain would.
        if current is not None and current.cancelling() > 1:
            return True
        log.info("dispatcher cancelled: finishing in-flight work, handing back the rest")
        return False

    async def close(self) -> None:
        if self._gate is not None:
            await self._gate.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    async def returned(self) -> None:
        self.watch.returned()
        self._watching.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._watching

    def finish(self, state: AsyncState) -> None:
        self.dispatcher._state = None


CANCELLED_WITHIN = 1.0  # seconds a cancelled part's task gets to run its clean-up
