"""A database that takes no writes: a standby (in recovery), or a server set read-only.

A DSN can reach one during a failover (DNS not yet moved, a replica listed without
``target_session_attrs=read-write``). Every statement of the dispatcher writes, so such a
connection is refused as it opens (the probe reads ``pg_is_in_recovery()`` and
``transaction_read_only``), and a statement that meets SQLSTATE 25006 on an open one gives
it up the same way: ``ReadOnlyServer``, a connection error, so every part discards the
connection and reconnects with its backoff, silently, while libpq's host list or the DNS
finds the primary.

What it is said once per host (and process), whatever the number of parts and
attempts, naming the host and what to set; and once more when that host takes writes
again (promoted).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import psycopg

from ..errors import ConfigurationError

__all__ = ["ReadOnlyServer", "check_writable", "from_statement", "is_read_only",
           "standby_names"]

log = logging.getLogger("outbox.dispatcher")

READ_ONLY = "25006"  # read_only_sql_transaction: a standby, or a read-only session

_said: set[str] = set()
_lock = threading.Lock()


class ReadOnlyServer(psycopg.OperationalError):
    """The connection reached a server that takes no writes; it was closed, and is
    opened again with backoff (``CONNECTION_ERRORS`` catches it)."""


def is_read_only(exc: BaseException) -> bool:
    """Whether ``exc`` is PostgreSQL refusing a write on a read-only server."""
    return isinstance(exc, ReadOnlyServer) or getattr(exc, "sqlstate", None) == READ_ONLY


def _where(conn: Any) -> str:
    info = conn.info
    return f"host {info.host} port {info.port}"


def check_writable(conn: Any, in_recovery: bool, read_only: str, role: str) -> None:
    """Raise ``ReadOnlyServer`` (said once per host) if the probe found the server in
    recovery or read-only; else, if it was said of this host, say it takes writes."""
    where = _where(conn)
    if in_recovery:
        _say(where, f"the database at {where} is a standby (in recovery, read-only)", role)
    elif read_only == "on":
        _say(where, f"the database at {where} is read-only (transaction_read_only is on)",
             role)
    else:
        with _lock:
            if where not in _said:
                return
            _said.discard(where)
        log.warning("the database at %s takes writes again (promoted): dispatching", where)
        return
    raise ReadOnlyServer(f"the database at {where} takes no writes (a standby?)")


def from_statement(conn: Any, exc: psycopg.Error, role: str) -> ReadOnlyServer:
    """A statement met SQLSTATE 25006 on an open connection: the ``ReadOnlyServer`` to
    raise instead (said once per host); the caller discards the connection."""
    where = _where(conn)
    _say(where, f"the database at {where} refused a write as read-only ({READ_ONLY})",
         role)
    return ReadOnlyServer(f"the database at {where} takes no writes (a standby?)")


def _say(where: str, what: str, role: str) -> None:
    with _lock:
        if where in _said:
            return
        _said.add(where)
    log.error(
        "%s: the dispatcher's %s cannot write there, nor any part of it; reconnecting with "
        "backoff until it takes writes. For a failover, list every host in the DSN with "
        "target_session_attrs=read-write (libpq then connects to the primary only)",
        what, role)


def standby_names(value: bool | Sequence[str]) -> bool | tuple[str, ...]:
    """``wait_for_replicas`` checked: ``True`` (every streaming standby), ``False``, or
    the standbys' names (their ``application_name`` in ``pg_stat_replication``, as
    ``primary_conninfo`` or ``cluster_name`` sets it), at least one, each a non-empty
    string, as a tuple; ``ConfigurationError`` naming what is wrong otherwise."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ConfigurationError(
            f"wait_for_replicas must be True, False or a list of standby names "
            f"(application_name in pg_stat_replication), got {value!r}")
    names = tuple(value)
    if not names:
        raise ConfigurationError(
            "wait_for_replicas=[] names no standby: name at least one (application_name "
            "in pg_stat_replication), or pass True to wait for every streaming standby")
    for position, name in enumerate(names):
        if not isinstance(name, str) or not name.strip():
            raise ConfigurationError(
                f"wait_for_replicas[{position}] must be a standby's name (a non-empty "
                f"string, its application_name in pg_stat_replication), got {name!r}")
    if len(set(names)) != len(names):
        raise ConfigurationError(f"wait_for_replicas names a standby twice: {list(names)!r}")
    return names
