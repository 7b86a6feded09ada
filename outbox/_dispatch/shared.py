"""Limits shared across targets (``Limit(shared=True)``): the token buckets kept in the
dispatcher's limits home (an outbox schema, migration 0013), and the claimer's calls to
them.

    grant   before a target's claim of a shared effect: up to the room's worth of tokens
            (one short statement in the home; the target's claim then takes at most
            that many jobs)
    refund  after it: the tokens the claim did not use go back, so an idle target never
            holds the budget
    pause   a provider's throttle seen in any target empties the bucket for a while,
            so every target backs off

One ``HomeBudget`` per home in a process, whatever the number of dispatchers and
engines using it: one connection, opened at the first call and closed when the last
dispatcher holding it stops (``held``). A home that cannot be reached grants nothing (the
effect waits, logged once when the home goes and once when it is back); a refund or a
pause that cannot be written is logged and dropped (a lost refund under-uses the budget
for a moment, never over-uses it).

The claimer's steps ask for these calls by yielding ``HomeCall`` (the home is another
connection than the claimer's): its executor runs them, on a thread for the asyncio
dispatcher.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.rows import namedtuple_row

from .._pg import unreachable
from .._sql import queries
from ..targets import Target
from .network import network_options

__all__ = ["HOME_RETRY", "Grant", "HomeBudget", "HomeCall", "held", "home_budget"]

log = logging.getLogger("outbox.dispatcher")

HOME_RETRY = 1.0  # seconds before asking an unreachable home again
CONNECTING_RETRY = 0.05  # seconds before asking again while the connection opens
TCP_USER_TIMEOUT_MS = 5000  # a connection to the home that stops answering is given up
_CONNECT_TIMEOUT = 5


@dataclass(frozen=True, slots=True)
class Grant:
    """Tokens granted (``granted``), and when none were, the seconds until a token is
    worth asking for (``wait``)."""

    granted: int
    wait: float | None = None


@dataclass(frozen=True, slots=True)
class HomeCall:
    """An instruction of the claimer's steps: call ``fn`` (a call to the limits home, not
    a statement on the claimer's connection) and send back what it returns."""

    fn: Callable[[], Any]


class HomeBudget:
    """The shared buckets of one limits home, for every dispatcher of this process.

    A claim never waits to connect: without a connection, a grant answers "nothing yet"
    and a thread opens one (again HOME_RETRY seconds after a failure), so a home that is
    slow to answer or gone holds back only the shared effects, never the claims of the
    others. A connection that stops answering is given up after TCP_USER_TIMEOUT_MS.
    """

    def __init__(self, home: Target) -> None:
        self.home = home
        self.queries = queries(home.schema)
        self._lock = threading.Lock()  # the one connection runs one statement at a time
        self._conn: psycopg.Connection[Any] | None = None
        self._connecting = False
        self._retry_at = 0.0
        self._generation = 0  # close() moves it on: a connection opened before is dropped
        self._down = False
        self.holders = 0
        # Tokens of claims handed back unperformed (a run's end released them), by effect:
        # given back with the next grant of the effect, or when the last holder lets go.
        self._owed: dict[str, int] = {}
        self._owed_lock = threading.Lock()

    def owe(self, effect: str, count: int) -> None:
        """``count`` tokens of ``effect`` were spent on claims handed back unperformed (a
        release: the job goes back to pending and is claimed again, with a token of its
        own then): they are given back with the effect's next grant, or when the last
        holder lets go. No I/O: safe on any thread, and on an event loop."""
        if count > 0:
            with self._owed_lock:
                self._owed[effect] = self._owed.get(effect, 0) + count

    def _take_owed(self, effect: str | None = None) -> dict[str, int]:
        with self._owed_lock:
            if effect is None:
                owed, self._owed = self._owed, {}
                return owed
            count = self._owed.pop(effect, 0)
            return {effect: count} if count else {}

    def give_back_owed(self, effect: str | None = None) -> None:
        """Give back what ``owe`` kept (of ``effect``, or of every effect). Dropped if the
        home does not answer, as a refund is: under-used for a moment, never over-used."""
        for owed_effect, count in self._take_owed(effect).items():
            self.refund(owed_effect, count)

    def grant(self, effect: str, want: int, rate: float, burst: float | None) -> Grant:
        """Take up to ``want`` tokens of ``effect``'s shared bucket (``burst`` None: half a
        second's worth, at least 1, as an unshared limit's); what ``owe`` kept of the
        effect is given back first."""
        self.give_back_owed(effect)
        params = {"effect": effect, "want": want, "rate": rate,
                  "burst": max(1.0, rate / 2.0) if burst is None else burst}
        rows = self._execute(self.queries.shared_grant, params, "take tokens")
        if rows is None:  # connecting (ask again soon), or down (ask after the retry)
            return Grant(0, CONNECTING_RETRY if self._connecting else HOME_RETRY)
        row = rows[0]
        return Grant(int(row.granted), row.wait)

    def refund(self, effect: str, count: int) -> None:
        """Give ``count`` unused tokens of ``effect`` back (dropped if the home does not
        answer: the budget is under-used for a moment, never over-used)."""
        self._execute(self.queries.shared_refund, {"effect": effect, "count": count},
                      "give back tokens")

    def pause(self, effect: str, seconds: float) -> None:
        """Empty ``effect``'s shared bucket and grant nothing for ``seconds``. Called on
        a thread of its own: it connects and waits if it must."""
        self._execute(self.queries.shared_pause, {"effect": effect, "seconds": seconds},
                      "pause a shared limit", wait=True)

    def _execute(self, query: str, params: dict[str, Any], doing: str, *,
                 wait: bool = False) -> list[Any] | None:
        if wait and not self._connected():
            self._connect(doing, self._generation)
        with self._lock:
            conn = self._conn
            if conn is None or conn.closed:
                self._connect_in_background(doing)
                return None
            try:
                cursor = conn.execute(query, params)
                rows = cursor.fetchall() if cursor.description else []
            except psycopg.Error as exc:
                self._discard()
                self._retry_at = time.monotonic() + HOME_RETRY
                self._failed(exc, doing)
                return None
        if self._down:
            self._down = False
            log.warning("limits home %s answers again", self.home.name)
        return rows

    def _connected(self) -> bool:
        with self._lock:
            return self._conn is not None and not self._conn.closed

    def _connect_in_background(self, doing: str) -> None:
        """Under the lock: start opening the connection, unless under way or too soon."""
        if self._connecting or time.monotonic() < self._retry_at:
            return
        self._connecting = True
        threading.Thread(target=self._connect, args=(doing, self._generation), daemon=True,
                         name="outbox-limits-home").start()

    def _connect(self, doing: str, generation: int) -> None:
        try:
            conn = psycopg.connect(
                self.home.dsn, autocommit=True, application_name="outbox limits home",
                row_factory=namedtuple_row, **network_options(
                    self.home.dsn, connect_timeout=_CONNECT_TIMEOUT, keepalives_idle=5,
                    tcp_user_timeout=TCP_USER_TIMEOUT_MS))
        except psycopg.Error as exc:
            with self._lock:
                self._connecting = False
                self._retry_at = time.monotonic() + HOME_RETRY
            self._failed(exc, doing)
            return
        with self._lock:
            self._connecting = False
            if generation != self._generation or (
                    self._conn is not None and not self._conn.closed):
                conn.close()  # closed meanwhile, or another opened first
                return
            self._conn = conn

    def _failed(self, exc: psycopg.Error, doing: str) -> None:
        """Say once that the home does not answer (and why), not at each retry."""
        if self._down:
            return
        self._down = True
        why = (unreachable(exc, self.home.dsn) if isinstance(exc, psycopg.OperationalError)
               else exc.sqlstate or type(exc).__name__)
        if exc.sqlstate in ("42P01", "42883", "3F000"):  # no such table, function, schema
            why += f": is schema {self.home.schema!r} there migrated? run outbox migrate on it"
        log.warning("limits home %s: cannot %s (%s); shared limits grant nothing until it "
                    "answers", self.home.name, doing, why)

    def _discard(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(psycopg.Error):
                self._conn.close()
        self._conn = None

    def close(self) -> None:
        """Close the connection (the next call opens another)."""
        with self._lock:
            self._generation += 1
            self._discard()


_homes: dict[Target, HomeBudget] = {}
_homes_lock = threading.Lock()


def home_budget(home: Target) -> HomeBudget:
    """This process's ``HomeBudget`` for ``home``."""
    with _homes_lock:
        budget = _homes.get(home)
        if budget is None:
            budget = _homes[home] = HomeBudget(home)
        return budget


@contextlib.contextmanager
def held(home: Target | None) -> Iterator[None]:
    """Hold ``home``'s budget while a dispatcher runs; its connection is closed when the
    last holder lets go. Nothing to hold without a home."""
    if home is None:
        yield
        return
    budget = home_budget(home)
    with _homes_lock:
        budget.holders += 1
    try:
        yield
    finally:
        # Closed under the lock, only while nobody holds it: closed after the lock was
        # let go, it could cut off a holder that came in meanwhile (a fleet's next turn)
        # between its grant and its refund, and the refund, dropped, leaked tokens.
        with _homes_lock:
            budget.holders -= 1
            if budget.holders == 0:
                budget.give_back_owed()
                budget.close()
