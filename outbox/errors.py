"""Errors raised by outbox, and the outcome signals an effect raises.

The tree is split by what the caller can do about it::

    OutboxError                      base of everything outbox raises itself
    ├── EnqueueError                 the call to enqueue is wrong: fix the caller
    │   ├── InvalidKey               empty, too long or non-printable idempotency key
    │   ├── InvalidPayload           payload not JSON-serialisable (NaN, cycles, ...)
    │   │   └── InvalidArgument      effect, run_at or max_attempts wrong (also a TypeError)
    │   ├── UnknownEffect            effect name not among those registered (a typo?)
    │   ├── UnknownParent            after=[...] names a key of no job and no ledger row
    │   └── IdempotencyKeyConflict   key already used for another effect or payload
    ├── SchemaError                  database schema missing, or newer than this code
    ├── ReadOnlyDatabase             the database takes no writes: a standby (in
    │                                recovery), reached instead of the primary
    ├── ConfigurationError           a Dispatcher or CLI argument is invalid
    └── DispatcherFailed             a part of a running dispatcher died of an
                                     unexpected error (a bug): it stopped

    EffectOutcome                    raised *by an effect's perform()* to steer the job
    ├── Retry(after=None)            transient: try again later with the same key
    ├── Permanent(reason)            will never succeed: the job goes to ``failed``
    ├── Throttled(after=None)        the provider refused for load and did nothing: the
    │                                effect pauses for every dispatcher, the attempt is
    │                                not counted
    └── UnknownOutcome(reason)       the provider may have acted: retry with the same
                                     key while its idempotency window lasts, then
                                     ``reconcile``

Database errors from psycopg are not wrapped: they keep their own type (``psycopg.Error``)
so callers can handle connection loss the way they already do.
"""

from __future__ import annotations

from datetime import timedelta
from typing import overload

__all__ = [
    "ConfigurationError",
    "DispatcherFailed",
    "EffectOutcome",
    "EnqueueError",
    "IdempotencyKeyConflict",
    "InvalidArgument",
    "InvalidKey",
    "InvalidPayload",
    "OutboxError",
    "Permanent",
    "ReadOnlyDatabase",
    "Retry",
    "SchemaError",
    "Throttled",
    "UnknownEffect",
    "UnknownOutcome",
    "UnknownParent",
]


class OutboxError(Exception):
    """Base class of the errors outbox raises itself."""


class EnqueueError(OutboxError, ValueError):
    """An ``enqueue`` call was given something it cannot store. Nothing was written."""


class InvalidKey(EnqueueError):
    """The idempotency key is empty, longer than 255 characters or not printable ASCII."""


class InvalidPayload(EnqueueError):
    """The payload cannot be stored as JSON (not serialisable, NaN, too deep, ...)."""


class InvalidArgument(InvalidPayload, TypeError):
    """An argument of ``enqueue`` other than the payload is wrong: the effect name, ``run_at``
    or ``max_attempts``. Its message names the argument; a ``ValueError`` and a
    ``TypeError`` (it may be either mistake), and an ``InvalidPayload`` for code written
    when these were reported as one."""


class UnknownEffect(EnqueueError):
    """The effect name is not among those ``outbox.register_effects`` registered: most
    likely a typo. Nothing was written."""


class UnknownParent(EnqueueError):
    """``after=[...]`` names a key that holds no job and no ledger row (as the enqueue's
    transaction sees them): a job may wait only on jobs that exist, so it never waits in
    vain and no cycle can be built. ``keys`` holds the unknown keys. Nothing was written."""

    def __init__(self, keys: list[str], child: str) -> None:
        shown = ", ".join(repr(k) for k in keys[:5])
        more = f" and {len(keys) - 5} more" if len(keys) > 5 else ""
        super().__init__(
            f"job {child!r}: after=[...] names {shown}{more}, which no job and no ledger "
            "row holds: enqueue the parent first (in this transaction or an earlier one)")
        self.keys = keys


class IdempotencyKeyConflict(EnqueueError):
    """The key already names a job or ledger row with another effect or payload.

    A key names one business effect. Reusing it for a different request would make the
    provider either reject the call or silently return the first request's result, so
    enqueue refuses it instead. Nothing was written.
    """

    def __init__(self, key: str, detail: str) -> None:
        super().__init__(f"idempotency key {key!r} is already used {detail}")
        self.key = key


class SchemaError(OutboxError):
    """The outbox schema is missing, partly migrated, or newer than this code knows.

    Raised by ``enqueue`` and the dispatchers when the schema has no outbox tables, is
    older than this code (the message names the schema and the command to run) or newer;
    by ``migrate`` when the schema is newer than this code, its migration files are
    incomplete, or another process migrated it after this transaction's snapshot."""


class ReadOnlyDatabase(OutboxError):
    """The database refused the write as read-only (SQLSTATE 25006): the connection
    reached a standby (a server in recovery, during or after a failover), or runs a
    read-only transaction. Raised by ``enqueue``, ``enqueue_many`` and ``receive``
    instead of PostgreSQL's text; the transaction is aborted, nothing was written.

    Enqueue on the primary: a multi-host connection string with
    ``target_session_attrs=read-write`` lets libpq find it. The psycopg error is the
    ``__cause__``."""


class ConfigurationError(OutboxError, ValueError):
    """An argument given to a Dispatcher, a migration or the command line is invalid, or a
    setting that can never work: the database does not exist, the password is wrong, or
    the role lacks a privilege on the schema or its tables.

    Raised when a dispatcher or an adapter is built (a bad option), and at once by
    ``run_until_idle()`` and ``run()`` for a setting that can never work (``outbox run``
    then exits 1 with this one line). The message never contains the password."""


class DispatcherFailed(OutboxError):
    """A part of a running dispatcher (its recorder, a worker, its event loop) died of an
    unexpected error, so it stopped rather than run on degraded. The part's own error is
    the ``__cause__``. Outcomes it could not record are not lost: those jobs' leases
    expire and the rescuer retries them (at least once, with the same key)."""


def _delay_seconds(after: float | timedelta | None, signal: str) -> float | None:
    """A signal's ``after`` as seconds, refusing negative and NaN delays."""
    if isinstance(after, timedelta):
        after = after.total_seconds()
    if after is not None and not after >= 0:  # also refuses NaN
        raise ValueError(f"{signal}(after=...) must not be negative or NaN, got {after}")
    return after


class EffectOutcome(Exception):
    """Base of the signals an effect raises from ``perform`` to choose what happens next."""


class Retry(EffectOutcome):
    """Transient failure: the job is tried again later, with the same idempotency key.

    ``after`` (seconds or a timedelta) sets the earliest next attempt, e.g. from a
    provider's Retry-After header; without it the dispatcher backs off exponentially
    with full jitter. Every attempt counts against ``max_attempts``. A delay given as the
    only positional argument is ``after`` too: ``Retry(30)`` is ``Retry(after=30)``,
    ``Retry("reason", after=30)`` names the reason kept as the job's last error.

    :raises TypeError: a first argument that is neither a reason (a string) nor a delay
        (seconds, a timedelta, or None for none), or a delay given both positionally and
        as ``after``.
    """

    @overload
    def __init__(self, reason: str = "retry requested", *,
                 after: float | timedelta | None = None) -> None: ...

    @overload
    def __init__(self, after: float | timedelta | None, /) -> None: ...

    def __init__(self, reason: str | float | timedelta | None = "retry requested", *,
                 after: float | timedelta | None = None) -> None:
        if not isinstance(reason, str):
            # Retry(30): the contract's Retry(after=None) read positionally. Without this
            # the delay would become the reason and the retry come at the backoff's time.
            # None is no delay, as after=None (a Retry-After header that was absent).
            if isinstance(reason, bool) or not isinstance(reason, int | float | timedelta
                                                          | None):
                raise TypeError(f"Retry() takes a reason (a string) or a delay (seconds or "
                                f"a timedelta) first, got {type(reason).__name__}")
            if after is not None:
                raise TypeError("Retry() got a delay twice: positionally and as after=")
            after = reason
            reason = "retry requested"
        super().__init__(reason)
        self.reason = reason
        self.after = _delay_seconds(after, "Retry")


class Permanent(EffectOutcome):
    """The effect will never succeed as asked: the job goes to ``failed`` with ``reason``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class UnknownOutcome(EffectOutcome):
    """The provider may or may not have acted (e.g. a timeout after the request was sent).

    The job is retried with the same key, which the provider deduplicates, for as long as
    the provider remembers keys (the effect's ``unknown_outcome_window`` when it declares
    one, else the dispatcher's, 24 hours by default; counted from the first attempt).
    Past that window re-sending could act twice, so the job goes to ``reconcile`` for a
    person or a reconciler to settle.
    """

    def __init__(self, reason: str, *, after: float | timedelta | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.after = _delay_seconds(after, "UnknownOutcome")


class Throttled(EffectOutcome):
    """The provider refused for load and did nothing (HTTP 429, or 503 with Retry-After).

    Throttling is not a failure of the job: it goes back to ``pending`` with the attempt
    not counted, so no job ever ends ``failed`` for being throttled. The effect is paused
    for every dispatcher on the schema until ``after`` (seconds or a timedelta, e.g. the
    provider's Retry-After), or for an adaptive pause that grows with throttles in a row
    when the provider gave none; and its effective rate is cut (multiplicatively, at most
    once a second) and grows back additively while the provider stops refusing. When the
    effect declares no ``outbox.Limit``, a rate is learned: ``rate`` (performs per second)
    when the provider told its limit (a ``ratelimit-limit`` header), else what was
    completed just before; it is forgotten after a minute without throttling.
    ``reason`` is kept as the job's last error until it is done.
    """

    def __init__(self, after: float | timedelta | None = None,
                 reason: str = "throttled by the provider", *, rate: float | None = None,
                 ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.after = _delay_seconds(after, "Throttled")
        if rate is not None and not (isinstance(rate, int | float) and rate > 0):
            raise ValueError(f"Throttled(rate=...) must be a positive number, got {rate!r}")
        self.rate = None if rate is None else float(rate)
