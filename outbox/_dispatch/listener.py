"""The listener: turns enqueue notifications into wake-ups of the claimer, and an
operator's cancel of a running job into its perform's ``job.cancelled``.

Only a hint: the claimer polls too, so a missed notification delays a job by at most
one poll interval. A lost connection is reopened with backoff; an unexpected error is
logged and the listener restarted, since losing it would silently degrade wake-ups to
polling.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql

from .._enqueue import notify_channel
from .._pg import is_pooled
from ..errors import ConfigurationError
from .cancellation import notified
from .connection import CONNECTION_ERRORS, AsyncConnection, Connection
from .settings import Settings
from .state import AsyncState, SharedState

__all__ = ["POLLING", "Listener", "listen_async", "listen_statement"]

log = logging.getLogger("outbox.dispatcher")

NOTIFY_TIMEOUT = 0.25  # seconds between checks of the stop signal while listening
POLLING = ("the connection goes through a pooler, where LISTEN cannot work: polling "
           "(give the Dispatcher listen_conninfo, a direct connection, to be woken)")


def listen_statement(settings: Settings) -> sql.Composed:
    """``LISTEN`` on this schema's channel, the identifier quoted."""
    return sql.SQL("LISTEN {}").format(sql.Identifier(notify_channel(settings.schema)))


class Listener:
    """``Dispatcher``'s listener thread (``listen_async`` is ``AsyncDispatcher``'s)."""

    def __init__(
        self, settings: Settings, state: SharedState[Any],
        open_: Callable[[str], psycopg.Connection[Any]],
    ) -> None:
        self.settings = settings
        self.state = state
        self.conn = Connection(open_, "listener")

    def run(self) -> None:
        """Listen until the dispatcher stops; restart after any ``Exception``."""
        try:
            while not self.state.stopping.is_set():
                try:
                    self._listen()
                except CONNECTION_ERRORS:
                    self.conn.discard()
                    self.state.stopping.wait(self.conn.backoff())
                except ConfigurationError as exc:
                    log.error("cannot LISTEN (%s); polling instead", exc)
                    self.state.stopping.wait()
                except Exception:
                    log.exception("listener failed unexpectedly; restarting it")
                    self.conn.discard()
                    self.state.stopping.wait(self.conn.backoff())
        finally:
            self.conn.discard()

    def _listen(self) -> None:
        listening = self.conn.get()
        if is_pooled(listening):
            log.info(POLLING)
            self.state.stopping.wait()
            return
        listening.execute(listen_statement(self.settings))
        self.state.wake.set()  # jobs may have arrived while we were not listening
        while not self.state.stopping.is_set():
            for notify in listening.notifies(timeout=NOTIFY_TIMEOUT):
                if notify.payload:  # an operator's cancel of a running job
                    notified(self.state, notify.payload)
                self.state.wake.set()


async def listen_async(settings: Settings, state: AsyncState) -> None:
    """``Listener`` as a task of ``AsyncDispatcher``: wake-ups until cancelled; restart
    after any ``Exception``."""
    conn = AsyncConnection(settings, "listener")
    try:
        while True:
            try:
                listening = await conn.get()
                if is_pooled(listening):
                    log.info(POLLING)
                    return
                await listening.execute(listen_statement(settings))
                state.wake.set()  # jobs may have arrived while we were not listening
                async for notify in listening.notifies():
                    if notify.payload:  # an operator's cancel of a running job
                        notified(state, notify.payload)
                    state.wake.set()
            except CONNECTION_ERRORS:
                await conn.discard()
                await asyncio.sleep(conn.backoff())
            except ConfigurationError as exc:
                log.error("cannot LISTEN (%s); polling instead", exc)
                return
            except Exception:
                log.exception("listener failed unexpectedly; restarting it")
                await conn.discard()
                await asyncio.sleep(conn.backoff())
    finally:
        await conn.discard()
