"""The listener: turns enqueue notifications into wake-ups of the claimer, and an
operator's cancel of a running job into its perform's ``job.cancelled``.

Only a hint: the claimer polls too, so a missed notification delays a job by at most
one poll interval. A lost connection is reopened with backoff; an unexpected error is
logged and the listener restarted, since losing it would silently degrade wake-ups to
polling.
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg
from psycopg import sql

from .._enqueue import notify_channel
from .._pg import is_pooled
from ..errors import ConfigurationError
from .cancellation import notified
from .connection import CONNECTION_ERRORS, AsyncConnection, Connection
from .runtime import Call, Flavoured, Program, Wait
from .settings import Settings
from .state import SharedState

__all__ = ["POLLING", "listen_statement", "listening"]

log = logging.getLogger("outbox.dispatcher")

NOTIFY_TIMEOUT = 0.25  # seconds between checks of the stop signal while listening
POLLING = ("the connection goes through a pooler, where LISTEN cannot work: polling "
           "(give the Dispatcher listen_conninfo, a direct connection, to be woken)")


def listen_statement(settings: Settings) -> sql.Composed:
    """``LISTEN`` on this schema's channel, the identifier quoted."""
    return sql.SQL("LISTEN {}").format(sql.Identifier(notify_channel(settings.schema)))


def listening(settings: Settings, state: SharedState[Any],
              conn: Connection | AsyncConnection) -> Program[None]:
    """The listener's loop, written once (a program of ``runtime``): wake-ups until the
    dispatcher stops (``AsyncDispatcher`` cancels its task); restarted after a lost
    connection or any ``Exception``; ended behind a pooler or when LISTEN is refused
    (the claimer polls then)."""
    try:
        while not state.stopping.is_set():
            try:
                pg = yield Call(conn.get)
                if is_pooled(pg):
                    log.info(POLLING)
                    return
                yield Call(pg.execute, listen_statement(settings))
                state.wake.set()  # jobs may have arrived while we were not listening
                yield Flavoured(_hear, _hear_async, pg, state)
            except CONNECTION_ERRORS:
                yield Call(conn.discard)
                yield Wait(state.stopping, conn.backoff())
            except ConfigurationError as exc:
                log.error("cannot LISTEN (%s); polling instead", exc)
                return
            except Exception:
                log.exception("listener failed unexpectedly; restarting it")
                yield Call(conn.discard)
                yield Wait(state.stopping, conn.backoff())
    finally:
        yield Call(conn.discard)


def _hear(pg: psycopg.Connection[Any], state: SharedState[Any]) -> None:
    """Notifications on a blocking connection, until the dispatcher stops."""
    while not state.stopping.is_set():
        for notify in pg.notifies(timeout=NOTIFY_TIMEOUT):
            _heard(state, notify)


async def _hear_async(pg: psycopg.AsyncConnection[Any], state: SharedState[Any]) -> None:
    """Notifications on an asyncio connection, until the task is cancelled."""
    async for notify in pg.notifies():
        _heard(state, notify)


def _heard(state: SharedState[Any], notify: psycopg.Notify) -> None:
    if notify.payload:  # an operator's cancel of a running job
        notified(state, notify.payload)
    state.wake.set()
