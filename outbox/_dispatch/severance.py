"""A stop that ends even when the database does not answer: a dispatcher's connections
cut at ``stop_timeout``.

A dispatcher runs its claimer on the caller's thread (or task), so a claim blocked on a
server that stopped answering would hold ``run()`` however long the server takes.
Keepalives and ``tcp_user_timeout`` (``network``) end that within seconds when the network
or the host is gone; a server that is frozen while its machine still answers TCP (every
process stopped, a storage stall) acknowledges every packet, and nothing ends it. So when
a stop was asked and ``stop_timeout`` has passed while the claimer is still in its loop,
the sockets of the dispatcher's open connections are shut down (``shutdown(2)``, not
closed: the descriptor stays the connection's own until psycopg closes it): the blocked
call fails at once as a lost connection, the jobs still held are left to their leases
(``SharedState.abandon``), and ``run()`` returns. The drain counts its ``stop_timeout``
from the stop too, and a part still waiting for the database ``CUT_AFTER`` past it (the
recorder on a heartbeat) is cut the same way.

The watch that decides this is written once for both dispatchers (``StopWatch.watching``,
a program of ``runtime``): ``Dispatcher`` runs it on a thread, ``AsyncDispatcher`` as a
task of its loop, where its abandon runs beside the run's other tasks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from .connection import opened
from .crew import start_thread
from .runtime import Program, Wait
from .signals import Signal
from .state import SharedState
from .watchdog import cut

__all__ = ["Severance", "StopWatch", "cut"]

log = logging.getLogger("outbox.dispatcher")

STOP_CHECK = 0.25  # seconds between looks for a run that returned without a stop
# After a cut, how long the parts get to end: the server did not answer, so what they
# still had to write will not be written (those jobs are left to their leases).
CUT_GRACE = 0.5
# The claimer left its loop and the drain left what it held at stop_timeout, but the run
# has not returned this long after: a part still waits for the database, cut it.
CUT_AFTER = 1.0


class Severance:
    """The open connections of one dispatcher, to cut at ``stop_timeout``."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.start = start_thread  # where a run's watch runs (a fleet's crew, or its own)

    def sever(self) -> int:
        """Shut down the socket of every open connection of this dispatcher's worker id
        (``connection.opened``: each part's, the vacuum's too); how many were cut."""
        return sum(1 for conn in opened(self.worker_id) if cut(conn))

    def watch(self, state: SharedState[Any], stop_timeout: float, lease: float,
              event: Callable[[], Signal]) -> StopWatch:
        """Watch one run: ``stop_timeout`` after a stop, if ``run()`` has not returned,
        cut the connections (and, if the claimer is still in its loop, leave what is
        held to its leases, as the drain does at its own deadline). ``event`` makes the
        flavour's signals (``threading.Event``, ``LoopEvent``); the flavour runs the
        watch's program (``StopWatch.watching``)."""
        return StopWatch(self, state, stop_timeout, lease, event)


class StopWatch:
    """One run's watch (``Severance.watch``), the same policy for both dispatchers:
    ``watching`` is a program (``runtime``) that the flavour runs beside the run, on a
    thread (``Severance.start``) or as a task of its loop. Told when the claimer leaves
    its loop (``claimer_left``) and when ``run()`` returns (``returned``).

    The policy: wait for a stop; ``stop_timeout`` after it, if the run has not returned,
    leave what is held to its leases when the claimer is still in its loop (nobody else
    will), else wait ``CUT_AFTER`` more for the drain's own abandon to end the run; then
    cut the dispatcher's connections, wake the claimer's wait, and say so."""

    def __init__(self, severance: Severance, state: SharedState[Any], stop_timeout: float,
                 lease: float, event: Callable[[], Signal]) -> None:
        self._severance = severance
        self._state = state
        self._stop_timeout = stop_timeout
        self._lease = lease
        self._left = False
        self._returned = event()  # of the flavour's kind: what the program waits on
        self.cut = False
        self.stopped_at: float | None = None  # when the stop was seen

    def claimer_left(self) -> None:
        self._left = True

    def returned(self) -> None:
        self._returned.set()

    def grace(self, default: float) -> float:
        """How long to wait for a part to end after ``stop_timeout``: ``default``, but
        never past the stop + ``stop_timeout`` + ``CUT_AFTER`` + ``CUT_GRACE`` (a part
        still connecting to a server that does not answer cannot be cut)."""
        if self.stopped_at is None:
            return CUT_GRACE if self.cut else default
        last = self.stopped_at + self._stop_timeout + CUT_AFTER + CUT_GRACE
        return max(0.0, min(default, last - time.monotonic()))

    def deadline(self) -> float:
        """When the drain gives up: ``stop_timeout`` after the stop (not after the
        claimer left its loop, which a hung database may have delayed)."""
        now = time.monotonic()
        if self.stopped_at is None:
            return now + self._stop_timeout
        return min(now, self.stopped_at) + self._stop_timeout

    def watching(self) -> Program[None]:
        """The watch, until the run returns (or a task of it is cancelled)."""
        state, returned = self._state, self._returned
        while not (yield Wait(state.stopping, STOP_CHECK)):
            if returned.is_set():
                return  # ended without a stop (a start that failed)
        self.stopped_at = time.monotonic()
        if (yield Wait(returned, self._stop_timeout)):
            return
        if not self._left:  # the claimer is blocked: nobody else will abandon
            state.abandon(self._stop_timeout, self._lease)
        elif (yield Wait(returned, CUT_AFTER)):
            return  # the drain's abandon was enough
        self.cut = True
        cut = self._severance.sever()
        state.wake.set()  # the claimer's wait and the drain look again
        log.warning("stop_timeout (%gs) passed and the dispatcher still waits for the "
                    "database (a frozen or unreachable server?): %d connection(s) cut",
                    self._stop_timeout, cut)


