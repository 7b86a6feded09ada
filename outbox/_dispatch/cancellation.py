"""Telling performs to stop acting: who sets each held job's ``job.cancelled``, and the
watcher that sets it on time.

The reasons (``outbox._cancelling``) and who tells them::

    operator  the listener (a notification 'cancel <id> <claim_version>', sent by
              outbox cancel and the dashboard) and the recorder's heartbeat (its cancel
              column: the fallback where LISTEN cannot run), through ``notified`` and
              ``told_to_stop``
    lost      ``SharedState.lose``: the heartbeat found the claim taken over
    stop      ``SharedState.abandon``: stop_timeout passed after a stop
    timeout   the signal's own clock (the effect's ``timeout`` from the perform's start)
    lease     the signal's own clock (no heartbeat renewed the lease before it expired)

The two clocks are read by the perform itself at each ``is_set()``; the watcher
(``watching``, on a thread or as a task) checks them every ``SWEEP`` seconds so
that a perform blocked in ``wait()`` wakes, and an async perform's task is cancelled, on
time. What a job becomes once its perform was told is decided by ``_lifecycle.settle``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from .._cancelling import signal_of
from .runtime import Program, Wait
from .state import SharedState

__all__ = ["CANCEL_PREFIX", "SWEEP", "notified", "sweep", "told_to_stop", "watching"]

log = logging.getLogger("outbox.dispatcher")

SWEEP = 0.1  # seconds between two checks of the timeouts and the lease
CANCEL_PREFIX = "cancel "  # a notification's payload: 'cancel <job id> <claim_version>'


def told_to_stop(state: SharedState[Any], ids: Iterable[int],
                 version: int | None = None) -> None:
    """An operator cancelled these jobs (of claim ``version`` when given): tell their
    performs, where this dispatcher holds them."""
    for job_id in ids:
        held = state.held.get(job_id)
        if held is None or (version is not None and held.job.claim_version != version):
            continue
        signal = signal_of(held.job)
        if signal.reason is None:
            log.warning("job %s (key %s): cancelled by an operator while running; its "
                        "perform is told to stop", held.job.id, held.job.key)
        signal.tell("operator")


def notified(state: SharedState[Any], payload: str) -> None:
    """A notification on the schema's channel: an operator's cancel when its payload
    says so (the others are wake-ups, with an empty payload)."""
    if not payload.startswith(CANCEL_PREFIX):
        return
    try:
        job_id, version = (int(part) for part in payload[len(CANCEL_PREFIX):].split())
    except ValueError:
        log.warning("ignored a notification with an unexpected payload %r", payload[:100])
        return
    told_to_stop(state, [job_id], version)


def sweep(state: SharedState[Any], lease: float, now: float) -> None:
    """Set the signals whose timeout passed, and, when the leases may have expired (no
    heartbeat renewed them in time), those of the performs whose lease did."""
    watch = state.watch
    for signal in watch.due(now):
        if signal.reason is None and signal.check(now):
            log.warning("a perform ran past its effect's timeout; it is told to stop")
    if not watch.overdue(now, lease):
        return
    for held in list(state.held.values()):
        signal = signal_of(held.job)
        if held.started and signal.reason is None and signal.check(now):
            log.warning("job %s (key %s): its lease was not renewed in time (claim %s); "
                        "its perform is told to stop", held.job.id, held.job.key,
                        held.job.claim_version)


def watching(state: SharedState[Any], lease: float) -> Program[None]:
    """The watcher's loop (a program of ``runtime``): sweeps until every worker has
    returned, and ends as soon as they have (it waits on ``workers_ended_signal``
    between sweeps, so a run's end does not wait out a sweep's sleep)."""
    while not state.workers_done:
        if (yield Wait(state.workers_ended_signal, SWEEP)):
            return
        sweep(state, lease, time.monotonic())
