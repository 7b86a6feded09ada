"""The schedules table (migration 0014) as steps (``outbox._steps``): what a dispatcher
declares when it starts, and what an operator reads and changes (``outbox schedules``,
the dashboard). The statements are the blocks of ``sql/schedules.sql``; no I/O here.

Code wins: a schedule declared in a dispatcher's code replaces a stored one of the same
name when that dispatcher starts (and says so in a warning); an operator cannot store,
nor remove, a name the code declares (pause and resume apply to both).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cache

from ._sql import BoundQueries, bind_file
from ._steps import Statement, Step
from .schedules import Schedule

__all__ = [
    "Listed",
    "ScheduleQueries",
    "declare",
    "listing",
    "remove",
    "schedule_queries",
    "set_paused",
    "store",
]

log = logging.getLogger("outbox.schedules")

NOW = "SELECT now()"


class ScheduleQueries(BoundQueries):
    """The blocks of ``sql/schedules.sql`` bound to one schema."""

    def __init__(self, schema: str) -> None:
        self.schema = schema
        super().__init__(bind_file("outbox", "sql/schedules.sql", schema), "schedules.sql")


@cache
def schedule_queries(schema: str) -> ScheduleQueries:
    """The schedule statements for ``schema``, composed once per schema and process."""
    return ScheduleQueries(schema)


@dataclass(frozen=True, slots=True)
class Listed:
    """One schedule as ``outbox schedules`` and the dashboard show it."""

    name: str
    effect: str
    definition: str
    source: str
    paused: bool
    next_slot: datetime
    last_slot: datetime | None
    last_job_id: int | None
    last_status: str | None
    last_error: str | None
    updated_at: datetime

    @property
    def when(self) -> str:
        """When it fires, in a few words (``every 60s``, ``cron 0 3 * * * Europe/Berlin``)."""
        try:
            return Schedule.from_definition(self.name, json.loads(self.definition)).describe()
        except Exception:  # a definition this version cannot read: show it as stored
            return self.definition


def _now(now: datetime | None) -> Step[datetime]:
    if now is not None:
        return now
    [(at,)] = yield Statement(NOW, {})
    result: datetime = at
    return result


def declare(schedules: Sequence[Schedule], schema: str,
            now: datetime | None = None) -> Step[list[str]]:
    """Upsert the schedules a dispatcher declares (source 'code'); the names whose stored
    definition was replaced (each also logged as a warning)."""
    if not schedules:
        return []
    q = schedule_queries(schema)
    at = yield from _now(now)
    replaced = []
    for schedule in schedules:
        [(previous, _written)] = yield Statement(q.schedule_declare, {
            "name": schedule.name, "effect": schedule.effect,
            "definition": json.dumps(schedule.definition()),
            "next_slot": schedule.next_after(at)})
        if previous == "stored":
            replaced.append(schedule.name)
            log.warning("schedule %r is declared in the dispatcher's code and was also stored "
                        "(outbox schedules add): the code's definition replaces the stored "
                        "one", schedule.name)
    return replaced


def listing(schema: str) -> Step[list[Listed]]:
    """Every schedule with its state, by name."""
    rows: list[Listed] = yield Statement(schedule_queries(schema).schedule_list, {}, row=Listed)
    return rows


@dataclass(frozen=True, slots=True)
class Locked:
    """A schedule locked for an operator's change (``schedule_lock``)."""

    name: str
    definition: str
    source: str
    paused: bool
    next_slot: datetime


def _locked(schema: str, name: str) -> Step[Locked | None]:
    rows: list[Locked] = yield Statement(schedule_queries(schema).schedule_lock,
                                         {"name": name}, row=Locked)
    return rows[0] if rows else None


def store(schedule: Schedule, schema: str, actor: str, via: str) -> Step[str]:
    """Add or change an operator's schedule (audited): ``"added"``, ``"changed"``,
    ``"unchanged"``, or ``"code"`` when the code declares the name (nothing written)."""
    q = schedule_queries(schema)
    found = yield from _locked(schema, schedule.name)
    if found is not None and found.source == "code":
        return "code"
    at = yield from _now(None)
    definition = json.dumps(schedule.definition())
    yield Statement(q.schedule_store, {
        "name": schedule.name, "effect": schedule.effect, "definition": definition,
        "next_slot": schedule.next_after(at), "actor": actor, "via": via,
        "action": "schedule_add" if found is None else "schedule_change"})
    if found is None:
        return "added"
    same = json.loads(found.definition) == json.loads(definition)
    return "unchanged" if same else "changed"


def set_paused(name: str, paused: bool, schema: str, actor: str, via: str) -> Step[bool | None]:
    """Pause or resume ``name`` (audited): whether it changed; None if there is no such
    schedule. A resume starts from the next slot after now (the pause's are not caught
    up)."""
    found = yield from _locked(schema, name)
    if found is None:
        return None
    at = yield from _now(None)
    next_slot = Schedule.from_definition(name, json.loads(found.definition)).next_after(at)
    [(changed,)] = yield Statement(schedule_queries(schema).schedule_set_paused, {
        "name": name, "paused": paused, "next_slot": next_slot, "actor": actor, "via": via})
    return bool(changed)


def remove(name: str, schema: str, actor: str, via: str) -> Step[str]:
    """Remove a stored schedule (audited): ``"removed"``, ``"missing"``, or ``"code"``
    when the code declares it (nothing removed: pause it instead)."""
    found = yield from _locked(schema, name)
    if found is None:
        return "missing"
    if found.source == "code":
        return "code"
    yield Statement(schedule_queries(schema).schedule_remove,
                    {"name": name, "actor": actor, "via": via})
    return "removed"
