"""``wait_for_replicas``: a claimed job is performed only once the standbys hold its commit.

Asynchronous replication loses the last commits when the primary dies: an order committed
there, and its job, may be missing on the promoted standby. Performed before, its effect
is a phantom (a card charged for an order that no longer exists), and a key built from a
sequence is then handed out again for another order, which the provider drops as a
repeat. So each claimed batch is held until every streaming standby has flushed the WAL
up to the claim's commit (``pg_current_wal_insert_lsn()`` after the claim against
``pg_stat_replication.flush_lsn``): the claim commits after the enqueues it claims, so
their commits are on the standbys too, and whichever standby is promoted has the jobs
performed. ``wait_for_replicas=["standby1", ...]`` waits only for the standbys of those
names (``application_name``): the ones a failover may promote, not a reporting replica
or a far one allowed to lag. Named standbys none of which streams count as no standby.

    no standby streaming    nothing to wait for: performed at once (said once, and once
                            more when one streams again). A standby that is gone drops
                            out of pg_stat_replication (at once when its connection
                            closes, after wal_sender_timeout when it went silent).
    a standby behind        waited for, polling (1 ms, doubling to 50 ms), at most
                            ``REPLICA_WAIT_LIMIT`` seconds; then the batch is handed back
                            unperformed (pending, its attempt refunded) and claimed
                            again later: a lagging standby stalls the effects, as
                            synchronous replication stalls the commits, and never lets
                            one through unconfirmed.
    the primary gone        the wait fails: the batch is handed back, never performed.
    stopping                the batch is handed back.

Reading the standbys' positions needs ``pg_monitor`` (``pg_read_all_stats``) or a
superuser: checked at start (``require_access``), a ``ConfigurationError`` otherwise.
``Dispatcher`` waits on its claimer's thread and connection before handing the batch to
the workers; ``AsyncDispatcher`` in a task per batch, on a connection of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import psycopg

from .._sql import BoundQueries, bind_file
from .._steps import Statement, Step, run, run_async
from ..errors import ConfigurationError
from .connection import CONNECTION_ERRORS, AsyncConnection, Connection
from .held import Held, Release
from .settings import Settings
from .state import AsyncState, SharedState, ThreadState

__all__ = ["REPLICA_WAIT_LIMIT", "AsyncReplicaGate", "ReplicaGate", "access_step",
           "check_access", "check_access_async", "replica_queries"]

log = logging.getLogger("outbox.dispatcher")

REPLICA_WAIT_LIMIT = 30.0  # seconds a batch waits for a standby behind, then handed back
POLL_FIRST = 0.001  # seconds between looks at the standbys' positions, doubling ...
POLL_MAX = 0.05  # ... up to this


@cache
def replica_queries() -> BoundQueries:
    """The named blocks of ``sql/replicas.sql`` (no schema in them)."""
    return BoundQueries(bind_file("outbox", "sql/replicas.sql", "outbox"), "replicas.sql")


@dataclass(frozen=True, slots=True)
class Behind:
    """The streaming standbys that have not flushed a position yet, of how many."""

    behind: int
    streaming: int
    lagging: str | None


def access_step() -> Step[None]:
    """Refuse a role that cannot read the standbys' positions (``ConfigurationError``)."""
    rows = yield Statement(replica_queries().replica_access, {}, named=True)
    if not rows[0].allowed:
        raise ConfigurationError(
            f"wait_for_replicas reads the standbys' positions (pg_stat_replication), "
            f"which role {rows[0].role!r} may not: GRANT pg_monitor TO {rows[0].role} "
            "(or run without wait_for_replicas)")


def _position_step() -> Step[str]:
    rows = yield Statement(replica_queries().replica_wal_position, {}, scalar=True)
    return str(rows[0])


def _behind_step(lsn: str, names: list[str] | None) -> Step[Behind]:
    rows = yield Statement(replica_queries().replicas_behind, {"lsn": lsn, "names": names},
                           row=Behind)
    found: Behind = rows[0]
    return found


class _Gate:
    """What both gates share: the decision on each look, and saying it once."""

    def __init__(self, settings: Settings, state: SharedState[Any],
                 submit: Callable[[list[Held]], None]) -> None:
        self.state = state
        self.submit = submit
        self.enabled = bool(settings.wait_for_replicas)  # else each batch goes straight on
        # The standbys waited for, by application_name (None: every streaming one).
        named = settings.wait_for_replicas
        self.names = list(named) if isinstance(named, tuple) else None
        self.which = ("no standby" if self.names is None
                      else "none of the standbys named (" + ", ".join(self.names) + ")")
        self.alone = False  # no standby streamed at the last look (said)
        self.lagging = False  # a wait ran out (said)
        self.failed = False  # a look failed (said)

    def settled(self, behind: Behind, batch: list[Held], started: float) -> bool:
        """Whether the wait for ``batch`` is over after this look (handed over or back)."""
        if behind.streaming == 0:
            if not self.alone:
                self.alone = True
                log.warning("wait_for_replicas: %s streams from this primary: jobs "
                            "are performed without waiting (a failover now may lose "
                            "their orders)", self.which)
            self.done(batch)
            return True
        if self.alone:
            self.alone = False
            log.warning("wait_for_replicas: %d standby(s) stream again: jobs wait for them",
                        behind.streaming)
        if behind.behind == 0:
            self.done(batch)
            return True
        if self.state.stopping.is_set() or self.state.releasing:
            self.hand_back(batch)
            return True
        if time.monotonic() - started >= REPLICA_WAIT_LIMIT:
            if not self.lagging:
                self.lagging = True
                log.warning("wait_for_replicas: standby %s has not flushed a claim's commit "
                            "after %.0f s: its %d job(s) are handed back unperformed and "
                            "claimed again later", behind.lagging, REPLICA_WAIT_LIMIT,
                            len(batch))
            self.hand_back(batch)
            return True
        return False

    def done(self, batch: list[Held]) -> None:
        self.lagging = self.failed = False
        self.submit(batch)

    def hand_back(self, batch: list[Held]) -> None:
        """Not performed: back to pending, the attempt refunded (by the recorder)."""
        for held in batch:
            self.state.finish(held, Release())

    def look_failed(self, exc: psycopg.Error, batch: list[Held]) -> None:
        if not self.failed:
            self.failed = True
            log.warning("wait_for_replicas: cannot read the standbys' positions (%s): the "
                        "claimed jobs are handed back unperformed",
                        exc.sqlstate or type(exc).__name__)
        self.hand_back(batch)


class ReplicaGate(_Gate):
    """``Dispatcher``'s: ``submit`` holds each batch on the claimer's thread, reading the
    positions on the claimer's connection, until the standbys have its commit."""

    def __init__(self, settings: Settings, state: ThreadState, conn: Connection,
                 submit: Callable[[list[Held]], None]) -> None:
        super().__init__(settings, state, submit)
        self.thread_state = state
        self.conn = conn

    def __call__(self, batch: list[Held]) -> None:
        if not self.enabled or not batch:
            self.submit(batch)
            return
        started = time.monotonic()
        delay = POLL_FIRST
        try:
            lsn = run(_position_step(), self.conn.execute)
            while not self.settled(run(_behind_step(lsn, self.names), self.conn.execute), batch,
                                   started):
                self.thread_state.stopping.wait(delay)
                delay = min(delay * 2, POLL_MAX)
        except psycopg.Error as exc:
            self.look_failed(exc, batch)


class AsyncReplicaGate(_Gate):
    """``AsyncDispatcher``'s: each batch waits in a task of its own (the claimer goes on;
    what is held still counts against its capacity), on a connection of its own."""

    def __init__(self, settings: Settings, state: AsyncState,
                 submit: Callable[[list[Held]], None]) -> None:
        super().__init__(settings, state, submit)
        self.async_state = state
        self.conn = AsyncConnection(settings, "replicas")
        self.lock = asyncio.Lock()  # one statement at a time on the connection
        self.tasks: set[asyncio.Task[None]] = set()

    def __call__(self, batch: list[Held]) -> None:
        if not self.enabled or not batch:
            self.submit(batch)
            return
        task = asyncio.get_running_loop().create_task(self._wait(batch))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _wait(self, batch: list[Held]) -> None:
        started = time.monotonic()
        delay = POLL_FIRST
        try:
            async with self.lock:
                lsn = await run_async(_position_step(), self.conn.execute)
            while True:
                async with self.lock:
                    behind = await run_async(_behind_step(lsn, self.names),
                                             self.conn.execute)
                if self.settled(behind, batch, started):
                    return
                await self.async_state.stopping.wait(delay)
                delay = min(delay * 2, POLL_MAX)
        except psycopg.Error as exc:
            self.look_failed(exc, batch)
        except asyncio.CancelledError:
            self.hand_back(batch)
            raise

    async def close(self) -> None:
        """Hand back the batches still waiting (their tasks cancelled), then close."""
        for task in self.tasks:
            task.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
        with contextlib.suppress(psycopg.Error):
            await self.conn.discard()


def check_access(conn: Connection, settings: Settings) -> None:
    """At start, with ``wait_for_replicas``: refuse a role that cannot read the standbys'
    positions (``ConfigurationError``). Unreachable now: the first wait will tell."""
    if settings.wait_for_replicas:
        with contextlib.suppress(*CONNECTION_ERRORS):
            run(access_step(), conn.execute)


async def check_access_async(settings: Settings) -> None:
    """``check_access`` for ``AsyncDispatcher``, on a connection opened for it."""
    if not settings.wait_for_replicas:
        return
    conn = AsyncConnection(settings, "replicas")
    try:
        with contextlib.suppress(*CONNECTION_ERRORS):
            await run_async(access_step(), conn.execute)
    finally:
        await conn.discard()
