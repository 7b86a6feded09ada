"""Threads and connections a fleet's turns share instead of making their own each turn.

A dispatcher run alone starts its parts on threads of their own and opens its
connections when it starts; that is the right cost for one long run. A fleet
(``fleet``) runs every target in short turns, one after another: made fresh each turn,
those threads and connections would be most of the turn's work. So a fleet's engines
take them from here:

    Crew   long-lived daemon threads; ``start`` runs a part on an idle one (a new one
           only when none is idle) and returns a handle joined as a thread is
    Pool   the connections of finished turns, kept per (connection string, role) and
           handed to the next turn of any target of that database (every statement names
           its schema, and a connection's session settings are the same for every
           target); never more held, in use, idle or being opened, than ``capacity``;
           the least recently used idle one goes first. ``AsyncPool``: the same for
           the asyncio connections of ``AsyncDispatcher``'s turns, over one bookkeeping

``Dispatcher``'s engines are handed the crew's ``start`` and the pool's ``take`` and
``give``; an ``AsyncDispatcher``'s turn finds them in ``turn_share`` (a context variable
its task and every task it starts see), read where its connections open
(``AsyncConnection``), where its sync effects' threads start (``DaemonPool``) and where
its schema is checked. Without a fleet, ``start_thread`` and the plain connection open
and close are used: a dispatcher run alone is unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import select
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from queue import SimpleQueue
from typing import Any, Generic, Protocol, TypeVar

import psycopg
from psycopg.pq import TransactionStatus

__all__ = ["AsyncPool", "Crew", "Pool", "Share", "Started", "start_thread", "turn_share"]

log = logging.getLogger("outbox.dispatcher")

C = TypeVar("C", psycopg.Connection[Any], psycopg.AsyncConnection[Any])


class Started(Protocol):
    """What a part's starter returns: joined and looked at as a thread is."""

    name: str

    def join(self, timeout: float | None = None) -> None: ...

    def is_alive(self) -> bool: ...


def start_thread(target: Callable[[], object], name: str) -> Started:
    """``target`` on a daemon thread of its own, started (a dispatcher run alone)."""
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread


class _Run:
    """One part run by a crew member: done once ``target`` returned."""

    def __init__(self, target: Callable[[], object], name: str) -> None:
        self.target = target
        self.name = name
        self.done = threading.Event()

    def join(self, timeout: float | None = None) -> None:
        self.done.wait(timeout)

    def is_alive(self) -> bool:
        return not self.done.is_set()


class Crew:
    """Long-lived daemon threads running the parts of many turns, one after another.

    A member that ends a part goes back to the idle list; ``start`` takes an idle member
    or, when none is, starts a new one: the crew grows to the most parts ever running at
    once and no further. ``threads_started`` counts the threads it ever started."""

    def __init__(self, label: str = "outbox-crew") -> None:
        self._label = label
        self._lock = threading.Lock()
        self._idle: list[SimpleQueue[_Run | None]] = []
        self._members: list[SimpleQueue[_Run | None]] = []
        self._closed = False
        self.threads_started = 0

    def start(self, target: Callable[[], object], name: str) -> Started:
        """Run ``target`` on an idle member (or a new one); a handle to join."""
        run = _Run(target, name)
        with self._lock:
            if self._closed:
                raise RuntimeError("the crew is closed")
            if self._idle:
                inbox = self._idle.pop()
            else:
                inbox = SimpleQueue()
                self._members.append(inbox)
                self.threads_started += 1
                threading.Thread(target=self._serve, args=(inbox,), daemon=True,
                                 name=f"{self._label}-{self.threads_started}").start()
        inbox.put(run)
        return run

    def _serve(self, inbox: SimpleQueue[_Run | None]) -> None:
        me = threading.current_thread()
        own_name = me.name
        while (run := inbox.get()) is not None:
            me.name = run.name  # logs name the part, as a thread of its own would
            try:
                # A fresh context, as a new thread has: nothing a previous part set in a
                # context variable (a trace's span, a transaction block) leaks into it.
                contextvars.Context().run(run.target)
            except BaseException:  # parts are supervised; this is the last guard
                log.exception("%s failed unexpectedly", run.name)
            finally:
                me.name = own_name
                with self._lock:
                    if not self._closed:
                        self._idle.append(inbox)
                run.done.set()
            if self._closed:
                return

    def close(self) -> None:
        """End the idle members now and the busy ones once their part returns."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            self._members = []
        for inbox in idle:
            inbox.put(None)


Key = tuple[str, str]  # (connection string, role)


class _Kept(Generic[C]):
    """The pools' bookkeeping, no I/O: which connections are idle (oldest first) and in
    use, by key, and which to close to stay within ``capacity``. Call under ``lock``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.lock = threading.Lock()
        self.idle: OrderedDict[int, tuple[Key, C]] = OrderedDict()
        self.in_use: dict[int, Key] = {}
        self.opening = 0  # places taken by connections being opened (outside the lock)
        self.closed = False
        self.opened = 0

    def held(self) -> int:
        return len(self.idle) + len(self.in_use) + self.opening

    def reuse(self, key: Key, *others: Key) -> tuple[C | None, list[C]]:
        """A kept connection of ``key`` (or of any of ``others``) to hand out (None: open
        one for ``key``), and the ones to close: dead ones met on the way and, when a
        new one must be opened in a full pool, the least recently used idle ones of any
        key."""
        evicted: list[C] = []
        wanted = {key, *others}
        for ident, (kept_key, conn) in list(self.idle.items()):
            if kept_key not in wanted:
                continue
            del self.idle[ident]
            if _reusable(conn):
                self.in_use[ident] = kept_key
                return conn, evicted
            evicted.append(conn)
        while self.idle and self.held() >= self.capacity:
            evicted.append(self.idle.popitem(last=False)[1][1])
        self.opening += 1  # its place is taken now: two takers never both fill the last
        return None, evicted

    def opened_for(self, key: Key, conn: C | None) -> None:
        """The connection ``reuse`` left to open is open (None: opening it failed)."""
        self.opening -= 1
        if conn is not None:
            self.opened += 1
            self.in_use[id(conn)] = key

    def back(self, conn: C, *, recent: bool = True) -> tuple[bool, list[C]]:
        """``conn`` is given back: whether it is kept, and the idle ones to close (the
        capacity may have shrunk: the oldest idle ones go). ``recent=False``: kept as
        the least recently used, the first to go."""
        key = self.in_use.pop(id(conn), None)
        keep = key is not None and not self.closed and _reusable(conn)
        if keep:
            assert key is not None
            self.idle[id(conn)] = (key, conn)
            if not recent:
                self.idle.move_to_end(id(conn), last=False)
        evicted = []
        while self.idle and self.held() > self.capacity:
            evicted.append(self.idle.popitem(last=False)[1][1])
        return keep, evicted

    def close(self) -> list[C]:
        """Closed from now on: the idle ones to close (the ones in use as they come back)."""
        self.closed = True
        idle = [conn for _, conn in self.idle.values()]
        self.idle.clear()
        return idle


class _Pooled(Generic[C]):
    """What both pools share: the bookkeeping and the counts."""

    def __init__(self, capacity: int) -> None:
        self._kept: _Kept[C] = _Kept(capacity)

    @property
    def capacity(self) -> int:
        """At most this many connections held at once, in use and idle."""
        return self._kept.capacity

    @capacity.setter
    def capacity(self, value: int) -> None:
        with self._kept.lock:
            self._kept.capacity = max(1, value)

    @property
    def opened(self) -> int:
        """Connections the pool ever opened."""
        return self._kept.opened

    def held(self) -> int:
        """Connections held now, in use and idle."""
        with self._kept.lock:
            return self._kept.held()


class Pool(_Pooled[psycopg.Connection[Any]]):
    """Connections kept between turns, per (connection string, role), at most
    ``capacity`` of them held at once, in use or idle.

    ``take`` hands out an idle connection of that key (checked alive and outside any
    transaction) or opens one with ``open_``, first closing the least recently used
    idle one of another key when the pool is full. ``give`` takes one back: a
    connection closed, broken or inside a transaction is closed, never kept.
    ``opened`` counts the connections it ever opened. ``AsyncPool`` is its asyncio
    twin, over the same bookkeeping."""

    def take(self, key: Key, open_: Callable[[], psycopg.Connection[Any]],
             *others: Key) -> psycopg.Connection[Any]:
        """A connection for ``key``: a kept one (or one kept for any of ``others``, when
        any will do: the polling look-out reads a server's statistics on a connection
        to any database of it), else a new one from ``open_``."""
        with self._kept.lock:
            found, evicted = self._kept.reuse(key, *others)
        for old in evicted:
            _close(old)
        if found is not None:
            return found
        conn = None
        try:
            conn = open_()
        finally:
            with self._kept.lock:
                self._kept.opened_for(key, conn)
        return conn

    def give(self, conn: psycopg.Connection[Any], *, recent: bool = True) -> None:
        """Take ``conn`` back after a turn (or close it when it cannot be kept).
        ``recent=False`` (a look that found no work): kept as the least recently used,
        so the connections of the databases with recent work are the ones kept."""
        with self._kept.lock:
            keep, evicted = self._kept.back(conn, recent=recent)
        for old in evicted if keep else [conn, *evicted]:
            _close(old)

    def close(self) -> None:
        """Close every idle connection; the ones in use are closed as they come back."""
        with self._kept.lock:
            idle = self._kept.close()
        for conn in idle:
            _close(conn)


class AsyncPool(_Pooled[psycopg.AsyncConnection[Any]]):
    """``Pool`` for the asyncio connections of one event loop (``AsyncDispatcher``'s
    turns): the same keys, capacity and checks; ``take``, ``give`` and ``close``
    awaited."""

    async def take(self, key: Key,
                   open_: Callable[[], Awaitable[psycopg.AsyncConnection[Any]]],
                   *others: Key) -> psycopg.AsyncConnection[Any]:
        """A connection for ``key`` (or ``others``): a kept one, else a new one from
        ``open_``."""
        with self._kept.lock:
            found, evicted = self._kept.reuse(key, *others)
        for old in evicted:
            await _close_async(old)
        if found is not None:
            return found
        conn = None
        try:
            conn = await open_()
        finally:
            with self._kept.lock:
                self._kept.opened_for(key, conn)
        return conn

    async def give(self, conn: psycopg.AsyncConnection[Any], *, recent: bool = True,
                   ) -> None:
        """Take ``conn`` back after a turn (or close it when it cannot be kept);
        ``recent=False``: as the first to go (``Pool.give``)."""
        with self._kept.lock:
            keep, evicted = self._kept.back(conn, recent=recent)
        for old in evicted if keep else [conn, *evicted]:
            await _close_async(old)

    async def close(self) -> None:
        """Close every idle connection; the ones in use are closed as they come back."""
        with self._kept.lock:
            idle = self._kept.close()
        for conn in idle:
            await _close_async(conn)


@dataclass
class Share:
    """What an ``AsyncDispatcher``'s turn in a fleet takes from it (``turn_share``, set
    for the turn's task and so seen by every task it starts): its connections from the
    pool, its threads for sync effects from the crew, and whether its target's schema
    was already checked (at its first turn, and again after a failed one)."""

    pool: AsyncPool
    start: Callable[[Callable[[], object], str], Started]
    schema_seen: bool = False


# Set only inside a fleet's turn (``Fleet``): elsewhere None, and a dispatcher opens,
# starts and checks its own.
turn_share: ContextVar[Share | None] = ContextVar("outbox_turn_share", default=None)


def _reusable(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
    """Open, outside any transaction, and with nothing to read: an idle connection the
    server ended (restarted, terminated, timed out) has its farewell waiting, so it is
    dropped here rather than failing the next turn's first statement."""
    if conn.closed or conn.broken or conn.info.transaction_status != TransactionStatus.IDLE:
        return False
    try:
        readable, _, _ = select.select([conn.pgconn.socket], [], [], 0)
    except (OSError, ValueError, psycopg.Error):
        return False
    return not readable


def _close(conn: psycopg.Connection[Any]) -> None:
    with contextlib.suppress(Exception):
        conn.close()


async def _close_async(conn: psycopg.AsyncConnection[Any]) -> None:
    with contextlib.suppress(Exception):
        await conn.close()
