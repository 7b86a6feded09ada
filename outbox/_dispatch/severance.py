"""A stop that ends even when the database does not answer: ``Dispatcher``'s connections
cut at ``stop_timeout``.

``Dispatcher`` runs its claimer on the caller's thread, so a claim blocked on a server
that stopped answering would hold ``run()`` however long the server takes. Keepalives and
``tcp_user_timeout`` (``network``) end that within seconds when the network or the host
is gone; a server that is frozen while its machine still answers TCP (every process
stopped, a storage stall) acknowledges every packet, and nothing ends it. So when a stop
was asked and ``stop_timeout`` has passed while the claimer is still in its loop, the
sockets of the dispatcher's open connections are shut down (``shutdown(2)``, not closed:
the descriptor stays the connection's own until psycopg closes it): the blocked call
fails at once as a lost connection, the jobs still held are left to their leases
(``SharedState.abandon``), and ``run()`` returns. The drain counts its ``stop_timeout``
from the stop too, and a part still waiting for the database ``CUT_AFTER`` past it (the
recorder on a heartbeat) is cut the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
from typing import Any

import psycopg

from .connection import opened
from .crew import start_thread
from .state import AsyncState, ThreadState

__all__ = ["AsyncStopWatch", "Severance", "StopWatch", "cut"]

log = logging.getLogger("outbox.dispatcher")

STOP_CHECK = 0.25  # seconds between looks for a stop, while running
# After a cut, how long the parts get to end: the server did not answer, so what they
# still had to write will not be written (those jobs are left to their leases).
CUT_GRACE = 0.5
# The claimer left its loop and the drain left what it held at stop_timeout, but the run
# has not returned this long after: a part still waits for the database, cut it.
CUT_AFTER = 1.0


class Severance:
    """The open connections of one ``Dispatcher``, to cut at ``stop_timeout``."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.start = start_thread  # where a run's watch runs (a fleet's crew, or its own)

    def sever(self) -> int:
        """Shut down the socket of every open connection of this dispatcher's worker id
        (``connection.opened``: each part's, the vacuum's too); how many were cut."""
        return sum(1 for conn in opened(self.worker_id) if cut(conn))

    def watch(self, state: ThreadState, stop_timeout: float, lease: float) -> StopWatch:
        """Watch one run: ``stop_timeout`` after a stop, if ``run()`` has not returned,
        cut the connections (and, if the claimer is still in its loop, leave what is
        held to its leases, as the drain does at its own deadline)."""
        return StopWatch(self, state, stop_timeout, lease)


def cut(conn: Any) -> bool:
    """Shut down ``conn``'s socket (``shutdown(2)``: the descriptor stays psycopg's, to
    close): what waits on it fails at once as a lost connection. Whether it was cut."""
    with contextlib.suppress(OSError, psycopg.Error, ValueError):
        with socket.socket(fileno=os.dup(conn.pgconn.socket)) as sock:
            sock.shutdown(socket.SHUT_RDWR)
        return True
    return False


class StopWatch:
    """One run's watch (``Severance.watch``): told when the claimer leaves its loop
    (``claimer_left``) and when ``run()`` returns (``returned``)."""

    def __init__(self, severance: Severance, state: ThreadState, stop_timeout: float,
                 lease: float) -> None:
        self._severance = severance
        self._state = state
        self._stop_timeout = stop_timeout
        self._lease = lease
        self._left = threading.Event()
        self._returned = threading.Event()
        self.cut = False
        self.stopped_at: float | None = None  # when the stop was seen
        severance.start(self._watch, "outbox-stop-watch")

    def claimer_left(self) -> None:
        self._left.set()

    def returned(self) -> None:
        self._returned.set()

    def grace(self, default: float) -> float:
        """How long to wait for a part to end after ``stop_timeout``: ``default``, but
        never past the stop + ``stop_timeout`` + ``CUT_AFTER`` + ``CUT_GRACE`` (a part
        still connecting to a server that does not answer cannot be cut)."""
        return _grace(self.stopped_at, self._stop_timeout, self.cut, default)

    def deadline(self) -> float:
        """When the drain gives up: ``stop_timeout`` after the stop (not after the
        claimer left its loop, which a hung database may have delayed)."""
        return _deadline(self.stopped_at, self._stop_timeout)

    def _watch(self) -> None:
        state = self._state
        while not state.stopping.wait(STOP_CHECK):
            if self._returned.is_set():
                return
        self.stopped_at = time.monotonic() - STOP_CHECK / 2  # seen within STOP_CHECK
        if self._returned.wait(self._stop_timeout):
            return
        if not self._left.is_set():  # the claimer is blocked: nobody else will abandon
            state.abandon(self._stop_timeout, self._lease)
        elif self._returned.wait(CUT_AFTER):
            return  # the drain's abandon was enough
        self.cut = True
        cut = self._severance.sever()
        log.warning("stop_timeout (%gs) passed and the dispatcher still waits for the "
                    "database (a frozen or unreachable server?): %d connection(s) cut",
                    self._stop_timeout, cut)


class AsyncStopWatch:
    """``StopWatch`` for ``AsyncDispatcher``: a task on its loop."""

    def __init__(self, severance: Severance, state: AsyncState, stop_timeout: float,
                 lease: float) -> None:
        self._severance = severance
        self._state = state
        self._stop_timeout = stop_timeout
        self._lease = lease
        self._left = False
        self.cut = False
        self.stopped_at: float | None = None
        self._task = asyncio.get_running_loop().create_task(self._watch())

    def claimer_left(self) -> None:
        self._left = True

    def grace(self, default: float) -> float:
        """As ``StopWatch.grace``."""
        return _grace(self.stopped_at, self._stop_timeout, self.cut, default)

    async def _watch(self) -> None:
        state = self._state
        while not await state.stopping.wait(STOP_CHECK):
            pass
        self.stopped_at = time.monotonic()
        await asyncio.sleep(self._stop_timeout)
        if not self._left:  # the claimer is blocked: nobody else will abandon
            state.abandon(self._stop_timeout, self._lease)
        else:
            await asyncio.sleep(CUT_AFTER)  # cancelled if the run ends meanwhile
        self.cut = True
        cut = self._severance.sever()
        state.wake.set()  # the wind-down looks again
        log.warning("stop_timeout (%gs) passed and the dispatcher still waits for the "
                    "database (a frozen or unreachable server?): %d connection(s) cut",
                    self._stop_timeout, cut)

    def deadline(self) -> float:
        """As ``StopWatch.deadline``."""
        return _deadline(self.stopped_at, self._stop_timeout)

    async def close(self) -> None:
        """The run is over: stop watching."""
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


def _deadline(stopped_at: float | None, stop_timeout: float) -> float:
    now = time.monotonic()
    if stopped_at is None:
        return now + stop_timeout
    return min(now + stop_timeout, stopped_at + stop_timeout)


def _grace(stopped_at: float | None, stop_timeout: float, cut: bool, default: float) -> float:
    if stopped_at is None:
        return CUT_GRACE if cut else default
    last = stopped_at + stop_timeout + CUT_AFTER + CUT_GRACE
    return max(0.0, min(default, last - time.monotonic()))
