"""``outbox run``'s first connection: a server that cannot be reached at start is waited
for a bounded time, saying once where and for how long, then refused in one line.

A dispatcher on its own waits for an unreachable server forever (a database restarting
under a running fleet comes back); at the start of ``outbox run`` the likelier cause is a
wrong host or port, which waiting never fixes, so the wait is bounded by
``--wait-for-database`` (0 waits forever, as the dispatcher does)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import psycopg

from ._pg import configuration_error, unreachable
from .errors import ConfigurationError

log = logging.getLogger("outbox.cli")

CONNECT_TIMEOUT = 10  # seconds libpq waits for one attempt
BACKOFF_CAP = 5.0  # seconds between attempts, at most


def first_connection(conninfo: str, check: Callable[[psycopg.Connection[Any]], object],
                     wait: float) -> None:
    """Connect to ``conninfo`` and run ``check`` on the connection. A refusal no wait can
    change (a wrong password, no such database, an unmigrated schema, a connection string
    that does not parse) raises ``ConfigurationError`` at once; an unreachable server is
    tried again, with one warning saying where and for how long, until ``wait`` seconds
    have passed (0: forever), then ``ConfigurationError`` names it and the option."""
    try:
        _connect_or_wait(conninfo, check, wait)
    except KeyboardInterrupt:  # Ctrl-C while waiting: one line, not a traceback
        raise ConfigurationError("stopped while waiting for the database at "
                                 f"{unreachable(ConnectionError('Ctrl-C'), conninfo)}"
                                 ) from None


def _connect_or_wait(conninfo: str, check: Callable[[psycopg.Connection[Any]], object],
                     wait: float) -> None:
    started = time.monotonic()
    delay = 0.5
    warned = False
    while True:
        try:
            with psycopg.connect(conninfo, autocommit=True,
                                 connect_timeout=CONNECT_TIMEOUT) as conn:
                check(conn)
            return
        except psycopg.Error as exc:
            fatal = configuration_error(exc, conninfo, "connect")
            if fatal is not None:
                raise fatal from None
            where = unreachable(exc, conninfo)
        waited = time.monotonic() - started
        if wait and waited >= wait:
            raise ConfigurationError(
                f"cannot reach the database at {where} (tried for {waited:.0f}s; is the "
                f"server running, and are the host and port right? --wait-for-database "
                f"SECONDS waits longer, 0 forever)")
        if not warned:
            until = "until it answers" if not wait else f"for up to {wait:g}s"
            log.warning("cannot reach the database at %s; retrying %s", where, until)
            warned = True
        time.sleep(delay if not wait else min(delay, max(0.0, wait - waited)))
        delay = min(delay * 2, BACKOFF_CAP)
