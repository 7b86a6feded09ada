"""Facts about a PostgreSQL connection that outbox acts on: which errors no retry can fix,
and whether a connection goes through a transaction-pooling PgBouncer.

``configuration_error`` is the one place where a psycopg error is judged permanent (the
database does not exist, the password is wrong, the role lacks a privilege) and turned
into ``outbox.ConfigurationError``; everything else (a server down, restarting, out of
connections) stays a psycopg error that callers wait out with backoff.
"""

from __future__ import annotations

import functools
import re
import weakref
from typing import Any

import psycopg
from psycopg import pq
from psycopg.conninfo import conninfo_to_dict

from .errors import ConfigurationError, ReadOnlyDatabase, SchemaError

__all__ = ["configuration_error", "detect_pooler", "is_pooled", "read_only", "unmigrated",
           "unreachable"]

# SQLSTATE classes of statement errors that mean the set-up is wrong, not the moment:
# 28 invalid authorization, 3D no such database, 3F no such schema, 42 access rule
# violation (insufficient privilege, undefined table).
_FATAL_CLASSES = ("28", "3D", "3F", "42")

# libpq reports a refused connection as text only (no SQLSTATE): the server's (or
# PgBouncer's) reasons that waiting will not change.
_FATAL_CONNECT = re.compile(
    r"database \S+ does not exist|role \S+ does not exist|password authentication failed"
    r"|no pg_hba\.conf entry|authentication failed for user|no password supplied"
    r"|permission denied for database|is not permitted to log in|no such database"
    r"|no such user|invalid connection option|invalid dsn|invalid URI",
    re.IGNORECASE,
)
_SEVERITY = re.compile(r"^.*?\b(?:FATAL|ERROR):\s+", re.DOTALL)


def configuration_error(exc: BaseException, conninfo: str | None = None,
                        doing: str = "connect") -> ConfigurationError | None:
    """The ``ConfigurationError`` that ``exc`` amounts to, or None when waiting may help.

    Its text names the problem as the server put it, without the connection string's
    password (``conninfo`` is only used to find and remove it)."""
    if not isinstance(exc, psycopg.Error):
        return None
    problem = None if conninfo is None else conninfo_problem(conninfo)
    if problem is not None:
        return ConfigurationError(f"cannot {doing}: the connection string is not valid: "
                                  f"{problem}")
    text = str(exc).strip()
    sqlstate = exc.sqlstate
    if sqlstate is not None:
        if sqlstate[:2] not in _FATAL_CLASSES:
            return None
    elif not _FATAL_CONNECT.search(text):
        return None
    reason = _SEVERITY.sub("", text.splitlines()[0] if text else type(exc).__name__)
    return ConfigurationError(f"cannot {doing}: {_without_password(reason, conninfo)}")


# A quoted fragment of libpq's complaint about a connection string.
_QUOTED = re.compile(r'"([^"]*)"')


def conninfo_problem(conninfo: str) -> str | None:
    """What libpq's parser says is wrong with ``conninfo`` (``missing "=" after "dbname"
    in connection info string``), or None when it parses.

    libpq's complaint may quote the string, password and all: a quoted fragment is kept
    only when it is an option name (``"port"``) or punctuation (``"="``), else shown as
    ``"…"``."""
    try:
        conninfo_to_dict(conninfo)
    except psycopg.Error as exc:
        text = str(exc).strip()
        first = text.splitlines()[0] if text else type(exc).__name__
        return _QUOTED.sub(_shown_if_harmless, first)
    return None


def _shown_if_harmless(quoted: re.Match[str]) -> str:
    fragment = quoted.group(1)
    harmless = fragment in _option_names() or not any(c.isalnum() for c in fragment)
    return quoted.group(0) if harmless else '"…"'


@functools.cache
def _option_names() -> frozenset[str]:
    """libpq's connection option names (host, port, dbname, sslmode, ...)."""
    return frozenset(option.keyword.decode() for option in pq.Conninfo.get_defaults())


def _without_password(text: str, conninfo: str | None) -> str:
    password = conninfo_to_dict(conninfo).get("password") if conninfo else None
    return text.replace(str(password), "***") if password else text


# Connections found to go through a pooler; a weak set, so closed ones drop out.
_pooled: weakref.WeakSet[Any] = weakref.WeakSet()


def detect_pooler(conn: Any, backend_pid: int) -> bool:
    """Record and return whether ``conn`` goes through a pooler, given the backend pid
    the server reports for it (``SELECT pg_backend_pid()``).

    A pooler such as PgBouncer answers the client's start-up with a cancel key of its
    own, so the pid the client was told (``conn.info.backend_pid``) is not the pid of
    the server session; on a direct connection they are the same."""
    pooled: bool = backend_pid != conn.info.backend_pid
    if pooled:
        _pooled.add(conn)
    return pooled


def is_pooled(conn: Any) -> bool:
    """Whether ``detect_pooler`` found ``conn`` to go through a pooler."""
    return conn in _pooled


# A statement of ours that meets no schema, no table or no column: outbox was never
# migrated there, or is older than this code.
_UNMIGRATED = {"3F000": "no such schema", "42P01": "a table is missing",
               "42703": "a column is missing"}


def _sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of ``exc`` or of the driver error it wraps (psycopg 3, psycopg2,
    asyncpg; Django keeps it as ``__cause__``, SQLAlchemy as ``orig``)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        code = getattr(current, "sqlstate", None) or getattr(current, "pgcode", None)
        if isinstance(code, str):
            return code
        orig = getattr(current, "orig", None)
        current = orig if isinstance(orig, BaseException) else current.__cause__
    return None


def unmigrated(exc: BaseException, schema: str) -> SchemaError | None:
    """The ``SchemaError`` that a failed outbox statement amounts to when ``schema`` lacks
    the outbox tables (never migrated, or older than this code), else None."""
    what = _UNMIGRATED.get(_sqlstate(exc) or "")
    if what is None:
        return None
    return SchemaError(
        f"schema {schema!r} has no outbox tables or is older than this code ({what}): "
        f"run `outbox migrate --schema {schema}` (or outbox.migrate(conn, schema=...); "
        "in Django, `manage.py migrate`) first")


def read_only(exc: BaseException) -> ReadOnlyDatabase | None:
    """The ``ReadOnlyDatabase`` that a failed outbox write amounts to when the server
    refused it as read-only (a standby, SQLSTATE 25006), else None."""
    if _sqlstate(exc) != "25006":
        return None
    return ReadOnlyDatabase(
        "the database is read-only (a standby, in recovery, or a read-only transaction): "
        "outbox cannot write the job there. Connect to the primary: list every host in "
        "the connection string with target_session_attrs=read-write")


_FAILED_BECAUSE = re.compile(r".*failed:\s*(.+)$")


def unreachable(exc: BaseException, conninfo: str) -> str:
    """Where a connection failed and why, for a log line: ``host H port P: reason``.
    Never the password (libpq's text holds none; it is removed if it ever did)."""
    try:
        params = conninfo_to_dict(conninfo)
    except psycopg.Error:
        params = {}
    host = params.get("host") or params.get("hostaddr") or "the default socket"
    port = params.get("port") or "5432"
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    found = _FAILED_BECAUSE.search(first)
    reason = _SEVERITY.sub("", found.group(1) if found else first).strip()
    return f"host {host} port {port}: {_without_password(reason, conninfo)}"
