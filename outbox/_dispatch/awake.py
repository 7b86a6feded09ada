"""Awake: a dispatcher that keeps claiming says so in ``<schema>.awake``, so enqueues of
its effects need not notify (migration 0019).

A NOTIFY costs the business's transaction little alone, but PostgreSQL takes one lock
for the whole server at the commit of a transaction that notified, held through the
commit's flush: with many writers every enqueue made the commits queue behind each other.
A busy dispatcher needs no wake-up (it claims again at once), so:

- after the second busy round in a row (one that claimed jobs, or had no room to
  claim), the claimer marks itself awake for each effect it serves, for ``AWAKE_FOR``
  seconds (refreshed when half of that has passed, so a busy dispatcher writes here at
  most once every ``AWAKE_FOR / 2`` seconds). Not after the first: a dispatcher woken
  for one job hands it over at once, and sleeps again without having written anything;
- an enqueue notifies only when no dispatcher serving its effect is awake (and always
  outside READ COMMITTED, whose snapshot may predate a dispatcher's going to sleep);
- a claimer whose claim found nothing, and which is marked, first takes its rows away
  through ``fall_asleep``, which waits for every enqueue that saw it awake to end (the
  migration says how), then claims once more, and only then sleeps.

So an enqueue that did not notify has committed before the dispatcher's last claim, and
that claim sees its job; one that came later saw no row and notified. When the wait
times out (a business transaction that saw the rows is still open after
``FENCE_TIMEOUT``), that transaction's job waits at most a poll interval, as a missed
notification always did. A dispatcher that crashes while marked leaves rows that expire
``AWAKE_FOR`` seconds later; until then other dispatchers find such jobs by polling.

Dispatchers that never mark (``run_until_idle``, a fleet's turns, a release before
this one) look asleep to every enqueue, and are notified as before.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import psycopg

from .._steps import Statement, Step
from .settings import Settings

__all__ = ["AWAKE_FOR", "FENCE_TIMEOUT", "Awake"]

log = logging.getLogger("outbox.dispatcher")

AWAKE_FOR = 5.0
"""Seconds a mark holds; refreshed while the dispatcher keeps claiming."""
FENCE_TIMEOUT = "50ms"
"""How long ``fall_asleep`` waits for the enqueues that saw the mark (and how long an
enqueue arriving meanwhile may wait behind it)."""


@dataclass
class Awake:
    """One claimer's mark in ``<schema>.awake`` (one thread or task)."""

    settings: Settings
    enabled: bool = True
    marked_until: float = 0.0  # monotonic; 0: not marked
    busy_rounds: int = 0  # in a row

    def busy(self) -> Step[None]:
        """A round claimed jobs, or had no room to: from the second such round in a
        row, make sure the mark holds for a while."""
        self.busy_rounds += 1
        now = time.monotonic()
        if (not self.enabled or self.busy_rounds < 2
                or self.marked_until - now > AWAKE_FOR / 2):
            return
        try:
            yield Statement(self.settings.queries.awake_mark, {
                "worker": self.settings.worker_id, "effects": self.settings.effect_names,
                "seconds": AWAKE_FOR}, count=True)
        except (psycopg.errors.InsufficientPrivilege, psycopg.errors.UndefinedTable) as exc:
            self._refused(exc)
            return
        self.marked_until = now + AWAKE_FOR

    def asleep(self) -> Step[bool]:
        """A claim found nothing and the claimer is about to wait. True when it was
        marked: the mark is gone now, every enqueue that saw it has ended (or the wait
        timed out), and the claimer must claim once more before it sleeps."""
        self.busy_rounds = 0
        if not self.marked_until:
            return False
        self.marked_until = 0.0
        try:
            yield Statement(self.settings.queries.fall_asleep, {
                "worker": self.settings.worker_id, "timeout": FENCE_TIMEOUT}, scalar=True)
        except (psycopg.errors.InsufficientPrivilege, psycopg.errors.UndefinedTable,
                psycopg.errors.UndefinedFunction) as exc:
            self._refused(exc)
        return True

    def _refused(self, exc: psycopg.Error) -> None:
        self.enabled = False
        self.marked_until = 0.0
        log.warning(
            "cannot mark this dispatcher awake in %s.awake (%s): grant its role SELECT, "
            "INSERT, UPDATE and DELETE there; until then every enqueue notifies",
            self.settings.schema, exc.sqlstate or type(exc).__name__)
