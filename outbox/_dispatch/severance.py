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
(``SharedState.abandon``), and ``run()`` returns.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import weakref
from typing import Any

import psycopg

from .state import ThreadState

__all__ = ["Severance", "StopWatch"]

log = logging.getLogger("outbox.dispatcher")

STOP_CHECK = 0.25  # seconds between looks for a stop, while running
# After a cut, how long the parts get to end: the server did not answer, so what they
# still had to write will not be written (those jobs are left to their leases).
CUT_GRACE = 0.5


class Severance:
    """The open connections of one ``Dispatcher``, to cut at ``stop_timeout``."""

    def __init__(self) -> None:
        self._open: weakref.WeakSet[psycopg.Connection[Any]] = weakref.WeakSet()
        self._lock = threading.Lock()

    def track(self, conn: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
        """Remember ``conn`` (until it is garbage) and return it."""
        with self._lock:
            self._open.add(conn)
        return conn

    def sever(self) -> int:
        """Shut down the socket of every open connection; how many were cut."""
        with self._lock:
            conns = [c for c in self._open if not c.closed]
        cut = 0
        for conn in conns:
            with contextlib.suppress(OSError, psycopg.Error, ValueError):
                with socket.socket(fileno=os.dup(conn.pgconn.socket)) as sock:
                    sock.shutdown(socket.SHUT_RDWR)
                cut += 1
        return cut

    def watch(self, state: ThreadState, stop_timeout: float, lease: float) -> StopWatch:
        """Watch one run: ``stop_timeout`` after a stop, if ``run()`` has not returned,
        cut the connections (and, if the claimer is still in its loop, leave what is
        held to its leases, as the drain does at its own deadline)."""
        return StopWatch(self, state, stop_timeout, lease)


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
        threading.Thread(target=self._watch, name="outbox-stop-watch", daemon=True).start()

    def claimer_left(self) -> None:
        self._left.set()

    def returned(self) -> None:
        self._returned.set()

    def grace(self, default: float) -> float:
        """How long to wait for a part to end after ``stop_timeout``: ``default``, or
        ``CUT_GRACE`` once the connections were cut (nothing more can be written)."""
        return CUT_GRACE if self.cut else default

    def _watch(self) -> None:
        state = self._state
        while not state.stopping.wait(STOP_CHECK):
            if self._returned.is_set():
                return
        if self._returned.wait(self._stop_timeout):
            return
        if not self._left.is_set():  # the claimer is blocked: nobody else will abandon
            state.abandon(self._stop_timeout, self._lease)
        self.cut = True
        cut = self._severance.sever()
        log.warning("stop_timeout (%gs) passed and the dispatcher still waits for the "
                    "database (a frozen or unreachable server?): %d connection(s) cut",
                    self._stop_timeout, cut)
