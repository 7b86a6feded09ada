"""The dispatcher's presence: which effects it serves (a heartbeat row in
``<schema>.dispatchers``), and a warning for due jobs that no running dispatcher serves.

A job whose effect no dispatcher handles stays ``pending`` forever by design (a dispatcher
only claims its own effects), which is also what a typo in an effect name or a
dispatcher never deployed looks like. So each dispatcher, at its start and then every
``BEAT_INTERVAL`` seconds, records itself and looks at the due jobs: for every effect that
no live dispatcher serves, it logs a warning naming the effect and the count, once, and
again every ``REPEAT_INTERVAL`` while they still wait. Written as steps, like the
claimer, so both dispatchers run the same decisions.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import psycopg

from .._steps import Statement, Step
from ..registry import did_you_mean
from .settings import Settings
from .state import Timer

__all__ = ["BEAT_INTERVAL", "REPEAT_INTERVAL", "Presence"]

log = logging.getLogger("outbox.dispatcher")

BEAT_INTERVAL = 15.0
"""Seconds between heartbeats (and checks for unserved due jobs)."""
TTL = 4 * BEAT_INTERVAL
"""A dispatcher counts as running this long after its last heartbeat."""
REPEAT_INTERVAL = 600.0
"""Seconds between repeated warnings about one unserved effect."""
SCAN_LIMIT = 10_000
"""The due jobs of an unserved effect the check counts: up to twice this many (see the
``unhandled_due`` query)."""


@dataclass(frozen=True, slots=True)
class Unserved:
    """Due jobs of an effect no live dispatcher serves (``unhandled_due``): how many,
    and how long the oldest has waited, in seconds."""

    effect: str
    due: int
    oldest_age: float


@dataclass
class Presence:
    """One dispatcher's heartbeat and unserved-effect warnings (one thread or task)."""

    settings: Settings
    timer: Timer = field(default_factory=lambda: Timer(BEAT_INTERVAL))
    warned_at: dict[str, float] = field(default_factory=dict)
    enabled: bool = True

    def due(self, now: float) -> bool:
        """Whether a beat is due (the first one at once)."""
        return self.enabled and self.timer.due(now)

    def beat(self) -> Step[None]:
        """Record this dispatcher as live, then warn about unserved due jobs."""
        settings = self.settings
        try:
            yield Statement(settings.queries.dispatcher_beat, {
                "worker": settings.worker_id, "effects": settings.effect_names, "ttl": TTL,
            }, count=True)
        except psycopg.errors.InsufficientPrivilege as exc:
            self._refused(exc)
            return
        rows = yield Statement(settings.queries.unhandled_due, {"limit": SCAN_LIMIT},
                               row=Unserved)
        self.warn(rows, time.monotonic())

    def leave(self) -> Step[None]:
        """Take this dispatcher's row away (it stops)."""
        if self.enabled:
            yield Statement(self.settings.queries.dispatcher_leave,
                            {"worker": self.settings.worker_id}, count=True)

    def warn(self, rows: Sequence[Unserved], now: float) -> list[str]:
        """Log a warning for each unserved effect not warned about lately; return the
        effects warned about."""
        warned = []
        waiting = set()
        for unserved in rows:
            name = str(unserved.effect)
            waiting.add(name)
            last = self.warned_at.get(name)
            if last is not None and now - last < REPEAT_INTERVAL:
                continue
            self.warned_at[name] = now
            warned.append(name)
            log.warning(
                "%s due job(s) of effect %r have waited %.0fs and no running dispatcher "
                "handles %r (this one handles %s)%s: a typo in the effect name, or a "
                "dispatcher with that effect not running?",
                unserved.due, name, float(unserved.oldest_age), name,
                ", ".join(sorted(self.settings.effects)),
                did_you_mean(name, self.settings.effects))
        for name in set(self.warned_at) - waiting:  # served or gone: warn afresh next time
            del self.warned_at[name]
        return warned

    def _refused(self, exc: psycopg.Error) -> None:
        self.enabled = False
        log.warning(
            "cannot record this dispatcher in %s.dispatchers (%s): grant its role INSERT, "
            "UPDATE and DELETE there; until then `outbox status` counts its effects as "
            "served by no dispatcher, and due jobs nobody serves are not reported",
            self.settings.schema, exc.sqlstate or type(exc).__name__)
