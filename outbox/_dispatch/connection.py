"""The dispatcher's connections: how they are opened, and replaced when they break.

Every option a dispatcher connection gets is decided in ``connection_params``, the one
place to change when a role must connect elsewhere or differently (a direct connection
for LISTEN behind a pooler, say). ``Connection`` and ``AsyncConnection`` wrap one role's
connection: opened on first use, discarded when it broke, reopened with backoff.
"""

from __future__ import annotations

import contextlib
import random
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import psycopg

from .._pg import configuration_error, detect_pooler
from .._steps import Rows, Statement, execute, execute_async
from ..errors import ConfigurationError
from .crew import AsyncPool, turn_share
from .network import network_options
from .settings import Settings
from .standby import check_writable, from_statement
from .watchdog import begin, end, known, watching

__all__ = [
    "CONNECTION_ERRORS",
    "AsyncConnection",
    "ConnectParams",
    "Connection",
    "Reconnects",
    "connect",
    "connect_async",
    "connection_params",
    "opened",
]

# Errors after which a statement is retried as a whole (the recorder keeps its batch).
# psycopg raises OperationalError both for a lost connection and for transient failures
# on a healthy one (40001 serialization, 40P01 deadlock, 55P03 lock timeout, 57014
# statement timeout): ``Connection.lost`` tells them apart, and only a lost connection
# is replaced and counted as a reconnect.
CONNECTION_ERRORS = (psycopg.OperationalError, psycopg.InterfaceError)


@dataclass(frozen=True, slots=True)
class ConnectParams:
    """How to open one role's connection: where, with which options, then which
    session statements."""

    conninfo: str
    options: Mapping[str, Any]
    setup: tuple[str, ...]


def connection_params(settings: Settings, role: str) -> ConnectParams:
    """Everything about a dispatcher connection of ``role`` (claimer, recorder, listener)."""
    conninfo = settings.conninfo
    if role == "listener" and settings.listen_conninfo:
        conninfo = settings.listen_conninfo  # direct: LISTEN cannot go through a pooler
    return ConnectParams(
        conninfo=conninfo,
        options={
            "autocommit": True,
            "application_name": f"outbox {role} {settings.worker_id}"[:63],
            # Timeouts and keepalives: defaults under the string's own parameters.
            **network_options(conninfo),
        },
        setup=(
            # Explicit, whatever the server default: under REPEATABLE READ or
            # SERIALIZABLE, SKIP LOCKED raises serialization failures instead of
            # skipping. The timeout releases a dead worker's open transaction (we never
            # hold one on purpose).
            "SET default_transaction_isolation = 'read committed'",
            "SET idle_in_transaction_session_timeout = '60s'",
            # Abort a statement whose client has gone (PostgreSQL 14+), so a worker that
            # dies mid-claim leaves its claim rolled back instead of committed, orphaned.
            "SET client_connection_check_interval = '1s'",
        ),
    )


def connect(settings: Settings, role: str) -> psycopg.Connection[Any]:
    """A new connection for ``role``, set up; ``ConfigurationError`` if it can never be."""
    params = connection_params(settings, role)
    try:
        conn = psycopg.connect(params.conninfo, **params.options)
    except psycopg.Error as exc:
        raise _refused(exc, params, role) or exc from None
    # Tracked before its first statement: a server that freezes while it is set up
    # leaves it cuttable, by a stop (severance) and by the watchdog.
    _track(settings, conn, params.conninfo)
    try:
        with watching(conn):
            probe = conn.execute(PROBE).fetchone()
            _writable(conn, probe, role)
            for statement in _session_setup(conn, probe, params):
                conn.execute(statement)
    except BaseException:
        conn.close()
        raise
    return conn


async def connect_async(settings: Settings, role: str) -> psycopg.AsyncConnection[Any]:
    """A new asyncio connection for ``role``, set up; ``ConfigurationError`` if it can
    never be."""
    params = connection_params(settings, role)
    try:
        conn = await psycopg.AsyncConnection.connect(params.conninfo, **params.options)
    except psycopg.Error as exc:
        raise _refused(exc, params, role) or exc from None
    _track(settings, conn, params.conninfo)  # cuttable while it is set up, as above
    try:
        with watching(conn):
            probe = await (await conn.execute(PROBE)).fetchone()
            _writable(conn, probe, role)
            for statement in _session_setup(conn, probe, params):
                await conn.execute(statement)
    except BaseException:
        await conn.close()
        raise
    return conn


# Every connection opened, by the worker id of its dispatcher (weakly: a closed and
# dropped one leaves): what a stop cuts when the database hangs (``severance``).
_opened: dict[str, weakref.WeakSet[Any]] = {}
_opened_lock = threading.Lock()


def _track(settings: Settings, conn: Any, conninfo: str) -> None:
    with _opened_lock:
        _opened.setdefault(settings.worker_id, weakref.WeakSet()).add(conn)
    known(conn, conninfo)  # its statements watched for a server that stops answering


def opened(worker_id: str) -> list[Any]:
    """The open connections of the dispatchers of ``worker_id`` (blocking or asyncio)."""
    with _opened_lock:
        return [c for c in _opened.get(worker_id, ()) if not c.closed]


# -- behind a transaction-pooling PgBouncer -------------------------------------------------
# A pooled connection shares server sessions with other clients: a SET would leak into
# theirs, a prepared statement would be missing on the next session, a LISTEN would
# listen on a session this client no longer holds. So behind a pooler the dispatcher
# sends no session statement, prepares nothing, and LISTENs only on ``listen_conninfo``.

PROBE = ("SELECT pg_backend_pid(), current_setting('default_transaction_isolation'),"
         " pg_is_in_recovery(), current_setting('transaction_read_only')")


def _writable(conn: Any, probe: tuple[Any, ...] | None, role: str) -> None:
    """Refuse a standby or a read-only server (``ReadOnlyServer``, said once per host):
    every part of the dispatcher writes."""
    assert probe is not None
    check_writable(conn, probe[2], probe[3], role)


def _session_setup(conn: Any, probe: tuple[Any, ...] | None, params: ConnectParams,
                   ) -> tuple[str, ...]:
    """The session statements ``conn`` gets: ``params.setup`` on a direct connection,
    none through a pooler (whose role must then default to READ COMMITTED)."""
    assert probe is not None
    backend_pid, isolation = probe[:2]
    if not detect_pooler(conn, backend_pid):
        return params.setup
    conn.prepare_threshold = None
    if isolation != "read committed":
        raise ConfigurationError(
            f"through a connection pooler the dispatcher cannot SET its session, and "
            f"this role's default_transaction_isolation is {isolation!r}: make it 'read "
            "committed' for the dispatcher's role (ALTER ROLE ... SET "
            "default_transaction_isolation = 'read committed')")
    return ()


def _refused(exc: psycopg.Error, params: ConnectParams, role: str) -> ConfigurationError | None:
    return configuration_error(exc, params.conninfo, f"connect ({role} connection)")


class Reconnects:
    """Backoff between reconnection attempts (capped, jittered), reset by a success."""

    def __init__(self) -> None:
        self._failures = 0

    def backoff(self) -> float:
        """Seconds to wait before the next reconnection attempt (capped, jittered)."""
        self._failures += 1
        return random.uniform(0.05, min(5.0, 0.1 * 2**self._failures))

    def succeeded(self) -> None:
        self._failures = 0


class Connection(Reconnects):
    """One role's connection: autocommit, READ COMMITTED, keepalives, reconnecting."""

    def __init__(self, open_: Callable[[str], psycopg.Connection[Any]], role: str,
                 release: Callable[[psycopg.Connection[Any]], None] | None = None) -> None:
        super().__init__()
        self._open = open_
        self.role = role
        # Where ``discard`` puts the connection: closed, or given back to the pool of a
        # fleet's turns (``crew.Pool``: which closes one that broke).
        self._release = release or _close_quietly
        self._conn: psycopg.Connection[Any] | None = None

    def get(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = self._open(self.role)
        return self._conn

    @property
    def lost(self) -> bool:
        """Whether the connection is gone (after an error: lost, not a failed statement)."""
        return self._conn is None or self._conn.closed

    def execute(self, statement: Statement) -> Rows:
        """Run one statement (its own transaction); discard the connection if it broke."""
        watched = 0
        try:
            conn = self.get()
            watched = begin(conn)  # a frozen server noticed, its connections cut (watchdog)
            rows = execute(conn, statement)
        except CONNECTION_ERRORS:
            if self.lost:
                self.discard()
            raise
        except psycopg.errors.ReadOnlySqlTransaction as exc:
            read_only = from_statement(self._conn, exc, self.role)
            if self._conn is not None:  # never kept: the next one is probed
                _close_quietly(self._conn)
            self.discard()  # the next one is probed: a standby is refused as it opens
            raise read_only from exc
        finally:
            end(watched)
        self.succeeded()
        return rows

    def discard(self) -> None:
        if self._conn is not None:
            self._release(self._conn)
        self._conn = None


def _close_quietly(conn: psycopg.Connection[Any]) -> None:
    with contextlib.suppress(Exception):
        conn.close()


class AsyncConnection(Reconnects):
    """The asyncio twin of ``Connection``."""

    def __init__(self, settings: Settings, role: str) -> None:
        super().__init__()
        self._settings = settings
        self.role = role
        self._conn: psycopg.AsyncConnection[Any] | None = None
        # Inside a fleet's turn: the pool it came from, which takes it back (``crew``).
        self._pool: AsyncPool | None = None

    async def get(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is None or self._conn.closed:
            if self._conn is not None:  # closed under it (a stop's cut): not kept
                await self.discard()
            share = turn_share.get()
            if share is None:
                self._conn = await connect_async(self._settings, self.role)
            else:
                self._pool = share.pool
                self._conn = await share.pool.take(
                    (self._settings.conninfo, self.role),
                    partial(connect_async, self._settings, self.role))
        return self._conn

    @property
    def lost(self) -> bool:
        return self._conn is None or self._conn.closed

    async def execute(self, statement: Statement) -> Rows:
        watched = 0
        try:
            conn = await self.get()
            watched = begin(conn)  # a frozen server noticed, its connections cut (watchdog)
            rows = await execute_async(conn, statement)
        except CONNECTION_ERRORS:
            if self.lost:
                await self.discard()
            raise
        except psycopg.errors.ReadOnlySqlTransaction as exc:
            read_only = from_statement(self._conn, exc, self.role)
            if self._conn is not None:  # never kept: the next one is probed
                with contextlib.suppress(Exception):
                    await self._conn.close()
            await self.discard()
            raise read_only from exc
        finally:
            end(watched)
        self.succeeded()
        return rows

    async def discard(self) -> None:
        if self._conn is not None and self._pool is not None:
            await self._pool.give(self._conn)
        elif self._conn is not None:
            with contextlib.suppress(Exception):
                await self._conn.close()
        self._conn = None
