"""The dispatcher's options, validated once into a frozen ``Settings``.

``Dispatcher`` and ``AsyncDispatcher`` take the same keyword arguments and hand them to
``Settings.build``; every part reads its options from the result and never checks them
again.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import socket
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from .. import _lifecycle
from .._enqueue import effect_name_problem
from .._lifecycle import Backoff
from .._sql import Queries, check_schema_name, queries
from ..effect import Effect, is_async_effect
from ..errors import ConfigurationError
from ..limits import Limit
from ..observe import DispatchObserver
from ..registry import note_served
from ..targets import Target
from .hook_lookup import hooks_for
from .standby import standby_names

__all__ = ["Settings", "declared_timeouts", "declared_window", "text_array"]

log = logging.getLogger("outbox.dispatcher")


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Every option of a dispatcher, checked; see ``Dispatcher`` for their meaning."""

    # Connection strings may carry a password: never in a repr.
    conninfo: str = field(repr=False)
    listen_conninfo: str | None = field(default=None, repr=False)
    effects: Mapping[str, Effect]
    schema: str = "outbox"
    concurrency: int = 16
    lease: float = 30.0
    batch_size: int = 500
    prefetch: int | None = None
    max_prefetch: int = 4000
    poll_interval: float = 1.0
    rescue_interval: float = 5.0
    backoff: Backoff = field(default_factory=Backoff)
    unknown_outcome_window: float = 86400.0
    retention: float | None = 7 * 86400.0
    ledger_retention: float | None = 90 * 86400.0
    inbox_retention: float | None = 7 * 86400.0
    worker_id: str = ""
    observer: DispatchObserver = field(default_factory=DispatchObserver)
    # Declared limits by effect: the dispatcher's own, else the effect's default.
    limits: Mapping[str, Limit] = field(default_factory=dict)
    # Where the limits declared shared (Limit(shared=True)) are counted.
    limits_home: Target | None = None
    # Transient failures of an effect in a row that open its breaker (None: no breaker).
    breaker_threshold: int | None = 5
    # Derived once: the effect names as a text[] literal, and which effects are async.
    effect_names: str = ""
    async_names: frozenset[str] = frozenset()
    # Flows (``outbox.flows``): completion hooks per effect name (the effect's own
    # on_done / on_failed, or the dispatcher's mapping), and the reconciler's pace.
    done_hooks: Mapping[str, Callable[..., Any]] = field(default_factory=dict)
    failed_hooks: Mapping[str, Callable[..., Any]] = field(default_factory=dict)
    reconcile_interval: float = 60.0
    # After a stop: how long performs in flight may still run before ``run`` returns and
    # leaves the jobs still held to their leases.
    stop_timeout: float = 30.0
    # Perform a claimed job only once the streaming standbys hold its commit: every one
    # (True), or those of these names (pg_stat_replication.application_name).
    wait_for_replicas: bool | tuple[str, ...] = False
    # Derived once: each effect's ``timeout`` in seconds, for the effects declaring one.
    timeouts: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
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
        inbox_retention: float | timedelta | None = timedelta(days=7),
        worker_id: str | None = None,
        listen_conninfo: str | None = None,
        observer: DispatchObserver | None = None,
        on_done: Mapping[str, Callable[..., Any]] | None = None,
        on_failed: Mapping[str, Callable[..., Any]] | None = None,
        reconcile_interval: float | timedelta = 60.0,
        limits: Mapping[str, Limit] | None = None,
        breaker_threshold: int | None = 5,
        stop_timeout: float | timedelta = 30.0,
        limits_home: Target | str | None = None,
        wait_for_replicas: bool | Sequence[str] = False,
    ) -> Settings:
        """Check every option; raise ``ConfigurationError`` naming the first bad one."""
        indexed = _index_effects(effects)
        note_served(indexed)  # enqueue's "did you mean" in this process (outbox.registry)
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ConfigurationError(f"concurrency must be a positive integer, got {concurrency!r}")
        leased = _seconds(lease, "lease", minimum=1.0)
        retained = None if retention is None else _seconds(retention, "retention")
        ledger_kept = (None if ledger_retention is None
                       else _seconds(ledger_retention, "ledger_retention"))
        if retained is not None and ledger_kept is not None and ledger_kept < retained:
            raise ConfigurationError("ledger_retention must not be shorter than retention")
        inbox_kept = (None if inbox_retention is None
                      else _seconds(inbox_retention, "inbox_retention"))
        if backoff is not None and not isinstance(backoff, Backoff):
            raise ConfigurationError(f"backoff must be an outbox.Backoff, got {backoff!r}")
        if listen_conninfo is not None and not isinstance(listen_conninfo, str):
            raise ConfigurationError(
                f"listen_conninfo must be a connection string or None, "
                f"got {type(listen_conninfo).__name__}")
        if observer is not None and not isinstance(observer, DispatchObserver):
            raise ConfigurationError(
                f"observer must be an outbox.observe.DispatchObserver, "
                f"got {type(observer).__name__}")
        if worker_id is not None and not isinstance(worker_id, str):
            raise ConfigurationError(f"worker_id must be a string, got {worker_id!r}")
        home = _home(limits_home)
        waits_for = standby_names(wait_for_replicas)
        return cls(
            conninfo=conninfo,
            listen_conninfo=listen_conninfo,
            effects=indexed,
            schema=check_schema_name(schema),
            concurrency=concurrency,
            lease=leased,
            batch_size=_positive(
                max(concurrency, 500) if batch_size is None else batch_size, "batch_size"),
            prefetch=None if prefetch is None else _positive(prefetch, "prefetch", 0),
            max_prefetch=_positive(max_prefetch, "max_prefetch", 0),
            poll_interval=_seconds(poll_interval, "poll_interval", minimum=0.001),
            rescue_interval=_seconds(
                rescue_interval if rescue_interval is not None else min(leased, 5.0),
                "rescue_interval", minimum=0.01),
            backoff=backoff or Backoff(),
            unknown_outcome_window=_seconds(
                unknown_outcome_window, "unknown_outcome_window", minimum=0.0),
            retention=retained,
            ledger_retention=ledger_kept,
            inbox_retention=inbox_kept,
            worker_id=worker_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}",
            observer=observer or DispatchObserver(),
            limits=_check_shared(_limits(limits, indexed), home),
            limits_home=home,
            breaker_threshold=(None if breaker_threshold is None
                               else _positive(breaker_threshold, "breaker_threshold")),
            effect_names=text_array(sorted(indexed)),
            async_names=frozenset(n for n, e in indexed.items() if is_async_effect(e)),
            done_hooks=hooks_for(indexed, "on_done", on_done),
            failed_hooks=hooks_for(indexed, "on_failed", on_failed),
            reconcile_interval=_seconds(reconcile_interval, "reconcile_interval", minimum=0.01),
            stop_timeout=_seconds(stop_timeout, "stop_timeout", minimum=0.0),
            wait_for_replicas=waits_for,
            timeouts=declared_timeouts(indexed),
        )

    @property
    def queries(self) -> Queries:
        """The named SQL blocks bound to this schema (composed once per process)."""
        return queries(self.schema)

    def window_for(self, effect: Effect) -> float:
        """The unknown-outcome window for ``effect``'s jobs: its own when it declares
        one, else the dispatcher's. Read at each decision (a property may change); a
        value that became invalid is logged and the dispatcher's window used."""
        try:
            declared = declared_window(effect)
        except Exception as exc:  # a property's bug must not stop the recording
            log.error("%s; using the dispatcher's unknown_outcome_window", exc)
            return self.unknown_outcome_window
        return self.unknown_outcome_window if declared is None else declared

    @property
    def has_sync(self) -> bool:
        """Whether any effect's ``perform`` is a plain method (run on threads)."""
        return len(self.async_names) < len(self.effects)

    def with_limits(self, added: Mapping[str, Limit]) -> Settings:
        """These settings with ``added`` over the limits in force, each replacing an
        effect's limit whole; checked as ``build`` checks ``limits``."""
        return dataclasses.replace(self, limits=_check_shared(
            {**self.limits, **_given_limits(added, self.effects)}, self.limits_home))

    def with_limits_home(self, home: Target | str | None) -> Settings:
        """These settings with shared limits counted in ``home`` (checked as ``build``
        checks ``limits_home``)."""
        found = _home(home)
        return dataclasses.replace(self, limits=_check_shared(self.limits, found),
                                   limits_home=found)


def _seconds(value: Any, what: str, minimum: float = 0.0) -> float:
    try:
        return _lifecycle.seconds(value, what=what, minimum=minimum)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(str(exc)) from None


def declared_window(effect: Effect) -> float | None:
    """``effect.unknown_outcome_window`` in seconds, or None when it declares none;
    ``TypeError`` / ``ValueError`` naming the effect when the value is not a duration."""
    value = getattr(effect, "unknown_outcome_window", None)
    if value is None:
        return None
    return _lifecycle.seconds(value, what=f"effect {effect.name!r}: unknown_outcome_window")


def declared_timeouts(effects: Mapping[str, Effect]) -> dict[str, float]:
    """Each effect's ``timeout`` in seconds (effects declaring None are absent);
    ``ConfigurationError`` naming the effect for anything but a positive, finite number
    of seconds (or a timedelta)."""
    found = {}
    for name, effect in effects.items():
        # The class attribute: an instance attribute of that name may mean something
        # else to the effect (effects.nats.PublishEvent's publish timeout).
        value = getattr(type(effect), "timeout", None)
        if value is None:
            continue
        if isinstance(value, timedelta):
            value = value.total_seconds()
        if (isinstance(value, bool) or not isinstance(value, int | float)
                or not 0 < value < math.inf):
            raise ConfigurationError(
                f"effect {name!r}: timeout must be a positive number of seconds (or None "
                f"for no timeout), got {getattr(type(effect), 'timeout', None)!r}")
        found[name] = float(value)
    return found


def _limits(given: Mapping[str, Limit] | None, effects: Mapping[str, Effect]) -> dict[str, Limit]:
    """The limits in force: each effect's declared ``limit``, overridden by ``given``."""
    found: dict[str, Limit] = {}
    for name, effect in effects.items():
        declared = getattr(effect, "limit", None)
        if declared is not None and not isinstance(declared, Limit):
            raise ConfigurationError(
                f"effect {name!r}: limit must be an outbox.Limit, got {declared!r}")
        if declared is not None:
            found[name] = declared
    return {**found, **_given_limits(given, effects)}


def _home(home: Target | str | None) -> Target | None:
    """``limits_home`` checked: a Target, or a connection string (schema ``outbox``)."""
    if home is None or isinstance(home, Target):
        return home
    if isinstance(home, str):
        return Target(home)
    raise ConfigurationError(
        f"limits_home must be an outbox.Target (or a connection string), got "
        f"{type(home).__name__}")


def _check_shared(limits: Mapping[str, Limit], home: Target | None) -> dict[str, Limit]:
    """``limits``, once sure that every limit declared shared has a home to count in."""
    shared = sorted(name for name, limit in limits.items() if limit.shared)
    if shared and home is None:
        raise ConfigurationError(
            f"the limit of {', '.join(shared)} is shared (Limit(shared=True)) but the "
            "dispatcher has no limits_home: give limits_home=outbox.Target(dsn, schema) "
            "(outbox run --limits-home DSN[#SCHEMA]), the outbox schema where every "
            "dispatcher sharing the limit counts it")
    return dict(limits)


def _given_limits(given: Mapping[str, Limit] | None,
                  effects: Mapping[str, Effect]) -> dict[str, Limit]:
    """``given`` checked: a mapping of the names of ``effects`` to ``outbox.Limit``."""
    if given is not None and not isinstance(given, Mapping):
        raise ConfigurationError(
            f"limits must be a dict of effect name -> outbox.Limit, got {type(given).__name__}")
    for name, limit in (given or {}).items():
        if name not in effects:
            raise ConfigurationError(
                f"limits names effect {name!r}, which this dispatcher does not run "
                f"(its effects: {', '.join(sorted(effects))})")
        if not isinstance(limit, Limit):
            raise ConfigurationError(
                f"limits[{name!r}] must be an outbox.Limit, got {limit!r}")
    return dict(given or {})


def _positive(value: Any, what: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigurationError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return value


def _index_effects(effects: Sequence[Effect]) -> dict[str, Effect]:
    if isinstance(effects, str | bytes | Effect) or not isinstance(effects, Iterable):
        raise ConfigurationError(
            f"effects must be a list of Effect objects, got {type(effects).__name__}"
        )
    indexed: dict[str, Effect] = {}
    for effect in effects:
        _require_instance(effect)
        name = getattr(effect, "name", None)
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"{type(effect).__name__} has no effect name")
        problem = effect_name_problem(name)  # the rule enqueue applies to the same name
        if problem:
            raise ConfigurationError(f"{type(effect).__name__}: {problem}")
        if not callable(getattr(effect, "perform", None)):
            raise ConfigurationError(f"effect {name!r} has no perform() method")
        if name in indexed:
            raise ConfigurationError(f"two effects are named {name!r}")
        try:
            declared_window(effect)
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(str(exc)) from None
        indexed[name] = effect
    if not indexed:
        raise ConfigurationError("a Dispatcher needs at least one effect")
    return indexed


def _require_instance(effect: object) -> None:
    """Refuse an Effect class (``SendEmail`` for ``SendEmail(...)``) in words that say so,
    before its class attributes (a property object for a window) make a stranger error."""
    if isinstance(effect, type):
        raise TypeError(
            f"effects holds the class {effect.__name__}, not an instance of it: "
            f"pass {effect.__name__}(...)")


def text_array(values: list[str]) -> str:
    """A PostgreSQL text[] literal, built once: cheaper than adapting a list per query."""
    quoted = ('"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values)
    return "{" + ",".join(quoted) + "}"
