"""Recurring effects: ``Schedule``, a named definition of when a job is enqueued, and
the pure arithmetic of its slots (no I/O here).

A schedule has slots: instants at which it wants one job. With ``every`` they are the
multiples of the period counted from the Unix epoch (``every=3600`` fires on the hour,
UTC, whatever the time zone); with ``cron`` they are the instants a five-field cron
expression matches on the wall clock of ``timezone`` (parsed by ``cronsim``, the parser
healthchecks.io runs, which follows Debian cron).

Each slot is enqueued once across every dispatcher and every restart: the slot's job key
is ``schedule:<name>:<slot in UTC, ISO 8601>`` (``slot_key``), so the enqueue's key
dedup makes a second enqueue of the same slot a no-op, and the schedule's state (the
last slot enqueued, the next slot due) lives in the database, advanced in the same
transaction as the enqueue.

Time zones and daylight saving time, as Debian (Vixie) cron does it:

- an expression with a fixed minute and hour (``30 2 * * *``) whose local time the clock
  skips (spring forward) fires once, at the first minute after the jump (03:00 when the
  clock goes from 02:00 to 03:00);
- one whose local time occurs twice (fall back) fires once, at the first occurrence;
- an expression with a wildcard hour or minute (``*/15 * * * *``, ``0 * * * *``) follows
  real time: it fires at every matching instant that exists, so twice in a repeated hour
  and not at all in a skipped one.

Missed slots (every dispatcher down, a deploy): ``catch_up="latest"`` enqueues the latest
missed slot only, ``"all"`` every missed slot but at most ``MAX_CATCH_UP`` (the most
recent ones; the older are skipped and logged), ``"skip"`` none: only a slot at most
``ON_TIME`` seconds old is enqueued.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import KW_ONLY, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError
from pydantic import BaseModel

from ._enqueue import (
    canonical_json,
    effect_name_problem,
    validate_group,
    validate_key,
    validate_priority,
)
from ._lifecycle import MAX_DURATION, shown_number
from .errors import ConfigurationError, EnqueueError

__all__ = [
    "CATCH_UP",
    "MAX_CATCH_UP",
    "MAX_NAME_LENGTH",
    "ON_TIME",
    "Plan",
    "Schedule",
    "slot_key",
]

CatchUp = Literal["latest", "all", "skip"]
CATCH_UP: tuple[CatchUp, ...] = ("latest", "all", "skip")
# At most this many missed slots are enqueued by one catch-up ("all"): the most recent.
# A thousand jobs go in one enqueue statement (milliseconds) and cover a day of a
# minutely schedule or 16 minutes of a secondly one; a longer outage of a fast schedule
# is better served by its latest thousand runs than by a flood after it.
MAX_CATCH_UP = 1000
# A slot a dispatcher gets to at most this late is on time, not missed (catch_up="skip"
# still enqueues it): a round comes about a second after a slot, a restart a few seconds.
ON_TIME = 60.0
MAX_NAME_LENGTH = 200  # the key adds "schedule:" and the slot; keys stop at 255
# How far before an instant the cron iteration starts, so that it enters a repeated
# hour from before it (an iteration started inside one would miss its second pass).
_CRON_RUN_UP = timedelta(hours=3)
_LOOKBACK = timedelta(days=1)  # how far back a cron catch-up looks first (see _due)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICRO = timedelta(microseconds=1)


def slot_key(name: str, slot: datetime) -> str:
    """The job key of ``name``'s slot at ``slot``: ``schedule:<name>:<UTC ISO 8601>``,
    e.g. ``schedule:nightly:2026-12-05T02:00:00Z``. The same slot gives the same key in
    every process, which is what makes its enqueue happen once."""
    at = slot.astimezone(UTC).replace(tzinfo=None).isoformat()
    return f"schedule:{name}:{at}Z"


@dataclass(frozen=True, slots=True)
class Plan:
    """What a round does with a schedule whose slot is due: enqueue ``slots`` (oldest
    first), leave ``skipped`` missed slots out (catch-up policy or bound), and wait for
    ``next_slot``."""

    slots: tuple[datetime, ...]
    skipped: int
    next_slot: datetime
    # True when more slots than ``skipped`` were missed, uncounted: a cron schedule's
    # catch-up looks back only as far as it needs (see ``Schedule.plan``).
    more_skipped: bool = False


@dataclass(frozen=True, eq=True)
class Schedule:
    """A recurring effect: a job of ``effect`` with ``payload`` at each slot.

    Exactly one of ``cron`` (a five-field expression, matched on the wall clock of
    ``timezone``, an IANA name such as ``"Europe/Berlin"``) and ``every`` (seconds or a
    ``timedelta``; slots are multiples of it from the Unix epoch). ``catch_up`` says what
    happens to slots missed while no dispatcher ran: ``"latest"`` (default) enqueues the
    latest of them, ``"all"`` each of them (at most ``MAX_CATCH_UP``, the most recent),
    ``"skip"`` none. ``group`` and ``priority`` are the jobs' (as ``tx.enqueue``'s).

    Guarantees: each slot is enqueued at most once across every dispatcher and restart
    (its key, ``slot_key``, is derived from the name and the slot), and, unless the
    catch-up policy skips it, at least once by the next dispatcher that runs; the job's
    ``scheduled_for`` is the slot. Everything is checked here: a bad value raises
    ``outbox.ConfigurationError`` naming the schedule.

    :param name: The schedule's name, unique in the schema; part of each slot's key.
    :param effect: The effect each slot's job runs, e.g. ``"billing.nightly"``.
    :param cron: A five-field cron expression on ``timezone``'s wall clock (or ``every``).
    :param every: Instead of ``cron``: seconds or a ``timedelta`` between slots (from a
        millisecond to a century), counted from the Unix epoch.
    :param payload: The jobs' payload (a JSON-serialisable mapping or a pydantic model).
    :param timezone: The IANA time zone ``cron`` is read in (default UTC).
    :param catch_up: Slots missed while no dispatcher ran: ``"latest"``, ``"all"``
        (at most ``MAX_CATCH_UP``) or ``"skip"``.
    :param group: The jobs' group (a tenant), as ``tx.enqueue``'s.
    :param priority: The jobs' priority (-1000..1000), as ``tx.enqueue``'s.
    """

    name: str
    _: KW_ONLY
    effect: str
    cron: str | None = None
    every: float | timedelta | None = field(default=None, compare=False)
    payload: Mapping[str, Any] | BaseModel | None = field(default=None, compare=False)
    timezone: str = "UTC"
    catch_up: str = "latest"
    group: str | None = None
    priority: int = 0
    # Derived once: the payload as canonical JSON, the period in microseconds, the zone.
    payload_json: str = field(init=False, repr=False)
    period: int | None = field(init=False, repr=False)
    zone: ZoneInfo = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        name = self.name
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"a Schedule needs a name (a non-empty string), got "
                                     f"{name!r}"[:200])
        what = f"schedule {name[:60]!r}"
        _check(what, lambda: validate_key(name, what="name"))
        if len(name) > MAX_NAME_LENGTH:
            raise ConfigurationError(f"{what}: the name is {len(name)} characters long; at "
                                     f"most {MAX_NAME_LENGTH} are allowed")
        if not isinstance(self.effect, str) or not self.effect.strip():
            raise ConfigurationError(f"{what}: effect must be an effect's name (a string "
                                     f"such as 'email.send'), got {self.effect!r}"[:200])
        problem = effect_name_problem(self.effect)  # its jobs' effect, as enqueue checks it
        if problem:
            raise ConfigurationError(f"{what}: {problem}")
        set_ = object.__setattr__
        set_(self, "period", _period(what, self.cron, self.every))
        if self.cron is not None:
            _check_cron(what, self.cron)
        set_(self, "zone", _zone(what, self.timezone))
        if self.catch_up not in CATCH_UP:
            raise ConfigurationError(
                f"{what}: catch_up must be one of 'latest', 'all', 'skip', got "
                f"{self.catch_up!r}"[:200])
        _check(what, lambda: validate_group(self.group))
        _check(what, lambda: validate_priority(self.priority))
        payload = {} if self.payload is None else self.payload
        set_(self, "payload_json", _check(what, lambda: canonical_json(payload)))

    # -- the definition as the database keeps it ---------------------------------------

    def definition(self) -> dict[str, Any]:
        """The definition as a JSON object (the ``schedules`` table's ``definition``)."""
        return {"effect": self.effect, "cron": self.cron,
                "every": None if self.period is None else self.period / 1e6,
                "payload": json.loads(self.payload_json), "timezone": self.timezone,
                "catch_up": self.catch_up, "group": self.group, "priority": self.priority}

    @classmethod
    def from_definition(cls, name: str, definition: Mapping[str, Any]) -> Schedule:
        """The schedule ``definition`` (as ``definition()`` made it) describes."""
        known = ("effect", "cron", "every", "payload", "timezone", "catch_up", "group",
                 "priority")
        given = {k: definition[k] for k in known if definition.get(k) is not None}
        return cls(name, **given)

    def describe(self) -> str:
        """When it fires, in a few words (``every 60s``, ``cron 0 3 * * * Europe/Berlin``)."""
        if self.cron is not None:
            return f"cron {self.cron}" + ("" if self.timezone == "UTC" else f" {self.timezone}")
        assert self.period is not None
        return f"every {self.period / 1e6:g}s"

    # -- slots ---------------------------------------------------------------------------

    def next_after(self, instant: datetime) -> datetime:
        """The first slot strictly after ``instant`` (an aware datetime), in UTC."""
        return next(self._slots_after(instant))

    def plan(self, next_slot: datetime, now: datetime) -> Plan:
        """What to do at ``now`` with the slots from ``next_slot`` (the slot due) on:
        the slots to enqueue, under ``catch_up``, and the next slot to wait for."""
        due, count, exact = self._due(next_slot, now)
        if not due:
            return Plan((), 0, self.next_after(max(now, next_slot - _MICRO)))
        if self.catch_up == "latest":
            taken: tuple[datetime, ...] = (due[-1],)
        elif self.catch_up == "skip":
            late = (now - due[-1]).total_seconds()
            taken = (due[-1],) if late <= ON_TIME else ()
        else:
            taken = tuple(due)
        return Plan(taken, count - len(taken), self.next_after(now), not exact)

    def _due(self, first: datetime, now: datetime) -> tuple[list[datetime], int, bool]:
        """The due slots in [first, now]: at most the last MAX_CATCH_UP, how many, and
        whether that count is all of them.

        With ``every`` it is arithmetic. A cron expression is iterated, so a long outage
        is not walked slot by slot (a year of a minutely schedule is half a million): the
        iteration starts a day back, then eight times further back each time, until the
        window holds what the policy keeps (MAX_CATCH_UP slots for "all", one otherwise)
        or reaches ``first``; the slots before the window are skipped, uncounted."""
        if self.period is not None:
            k_first = -(-_micros(first) // self.period)
            k_last = _micros(now) // self.period
            count = max(0, k_last - k_first + 1)
            start = max(k_first, k_last - MAX_CATCH_UP + 1)
            return [_at(k * self.period) for k in range(start, k_last + 1)], count, True
        wanted = MAX_CATCH_UP if self.catch_up == "all" else 1
        lookback = _LOOKBACK
        while True:
            window = max(first, now - lookback)
            kept: deque[datetime] = deque(maxlen=MAX_CATCH_UP)
            count = 0
            for slot in self._slots_after(window - _MICRO):
                if slot > now:
                    break
                kept.append(slot)
                count += 1
            if window == first or count >= wanted:
                return list(kept), count, window == first
            lookback *= 8

    def _slots_after(self, instant: datetime) -> Iterator[datetime]:
        """The slots strictly after ``instant``, in UTC, increasing."""
        if instant.tzinfo is None or instant.utcoffset() is None:
            raise ValueError("instant must be an aware datetime")
        if self.period is not None:
            k = _micros(instant) // self.period + 1
            while True:
                yield _at(k * self.period)
                k += 1
        assert self.cron is not None
        utc = instant.astimezone(UTC)
        # cronsim iterates the wall clock; started a while before the instant it walks
        # through a repeated hour as the clock does, then the slots are compared in UTC.
        for local in CronSim(self.cron, (utc - _CRON_RUN_UP).astimezone(self.zone)):
            slot = local.astimezone(UTC)
            if slot > utc:
                utc = slot
                yield slot


def _micros(at: datetime) -> int:
    return (at - _EPOCH) // _MICRO


def _at(micros: int) -> datetime:
    return _EPOCH + timedelta(microseconds=micros)


def _check(what: str, check: Any) -> Any:
    """``check()``'s result; its EnqueueError (what enqueue would refuse) as a
    ConfigurationError naming the schedule."""
    try:
        return check()
    except EnqueueError as exc:
        raise ConfigurationError(f"{what}: {exc}") from None


def _period(what: str, cron: object, every: object) -> int | None:
    """``every`` in whole microseconds (None with ``cron``); exactly one must be given."""
    if (cron is None) == (every is None):
        raise ConfigurationError(
            f"{what}: give exactly one of cron= (a five-field cron expression) and every= "
            f"(seconds or a timedelta), " + ("not both" if cron is not None else "got neither"))
    if every is None:
        return None
    seconds = every.total_seconds() if isinstance(every, timedelta) else every
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise ConfigurationError(f"{what}: every must be seconds (a number) or a timedelta, "
                                 f"got {type(every).__name__}")
    if not seconds > 0:  # also NaN; compared before any float() of a huge int
        raise ConfigurationError(f"{what}: every must be more than 0 seconds, got {every!r}")
    if not seconds <= MAX_DURATION:  # its slots must stay inside the calendar
        raise ConfigurationError(f"{what}: every must be at most a century "
                                 f"({MAX_DURATION:.0f} seconds), got {shown_number(every)}")
    micros = round(seconds * 1e6)
    if micros < 1000:
        raise ConfigurationError(f"{what}: every must be at least a millisecond, got {every!r}")
    return micros


def _check_cron(what: str, cron: object) -> None:
    if not isinstance(cron, str):
        raise ConfigurationError(f"{what}: cron must be a string such as '0 3 * * *', got "
                                 f"{type(cron).__name__}")
    fields = cron.split()
    if len(fields) != 5:
        raise ConfigurationError(
            f"{what}: cron {cron!r} has {len(fields)} fields; it needs five (minute, hour, "
            "day of month, month, day of week), e.g. '0 3 * * *'")
    try:
        next(CronSim(cron, datetime(2000, 1, 1, tzinfo=UTC)))
    except (CronSimError, StopIteration) as exc:
        reason = str(exc) or "it never matches"
        raise ConfigurationError(f"{what}: cron {cron!r} is not a valid cron expression "
                                 f"({reason})") from None


def _zone(what: str, timezone: object) -> ZoneInfo:
    if not isinstance(timezone, str) or not timezone:
        raise ConfigurationError(f"{what}: timezone must be an IANA time zone name such as "
                                 f"'Europe/Berlin', got {timezone!r}"[:200])
    try:
        return ZoneInfo(timezone)
    except (ZoneInfoNotFoundError, ValueError):
        raise ConfigurationError(f"{what}: unknown time zone {timezone!r} (an IANA name such "
                                 "as 'Europe/Berlin' or 'UTC')"[:200]) from None

