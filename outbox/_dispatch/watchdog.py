"""A database that stops answering while the dispatcher runs: noticed within seconds,
said, and its connections cut, so every part reconnects by itself.

Keepalives and ``tcp_user_timeout`` (``network``) end a connection whose peer is gone
from the network, within 8 seconds. A server that is frozen while its machine still
answers TCP (every process stopped, a storage stall, a hung host whose kernel lives)
acknowledges every packet and every keepalive: a statement sent to it waits for ever,
and the part that sent it with it. So each statement of a dispatcher's connections
(``Connection.execute`` and its asyncio twin) is registered while in flight; one thread
per process looks at them every ``LOOK_EVERY`` seconds, and when one has waited
``HANG_AFTER`` seconds it asks the server's host, on a fresh connection, for
``SELECT 1``:

    answered            a slow statement on a live server (a long purge, a lock):
                        nothing is done (asked again ``ASK_AGAIN`` seconds later, if
                        it still waits). A quick error (too many connections, refused)
                        counts as an answer: not a frozen server.
    no answer within    the server is frozen or cut off (and the statement still
    PROBE_TIMEOUT       waits): said once (one line naming the host, how long it has
                        not answered, what happens), and every open dispatcher
                        connection to that host is cut (``sever``): the
                        blocked statements fail as lost connections, each part
                        reconnects with its backoff, and a multi-host DSN
                        (``target_session_attrs=read-write``) finds the promoted
                        standby. Jobs held are left to their leases, as after any lost
                        connection.
    then                the host is asked again every ``REPROBE`` seconds; when it
                        answers that is said once (the parts have reconnected to it by
                        then, or to another host); a host that refuses connections
                        (down, not frozen) or is still silent after ``FORGET`` seconds
                        is not asked again.

A statement in flight is noticed ``HANG_AFTER`` + ``LOOK_EVERY`` + ``PROBE_TIMEOUT``
(+ 0.5) seconds into a freeze at most: 7.5, within the 10 promised. A statement that got
its answer while its server was being asked proves the server there: nothing is cut. A
stop during the freeze is ``severance``'s: it cuts what still waits at
``stop_timeout``. The thread runs while a dispatcher connection is open (or a host said
is asked again), no longer.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

__all__ = ["HANG_AFTER", "PROBE_TIMEOUT", "begin", "cut", "end", "known", "watching"]

log = logging.getLogger("outbox.dispatcher")

HANG_AFTER = 1.5  # seconds a statement waits for its answer before the server is asked
# Seconds the server gets to answer a fresh connection's SELECT 1: generous, as a loaded
# machine may take seconds to start a backend (3 s was seen to run out under load).
PROBE_TIMEOUT = 5
LOOK_EVERY = 0.5  # seconds between looks at the statements in flight
ASK_AGAIN = 5.0  # a statement whose server answered: asked again this much later
REPROBE = 2.0  # seconds between looks at a host said not to answer, until it does
FORGET = 600.0  # a host silent this long after it was said is no longer asked


@dataclass(slots=True)
class _Flight:
    conn: Any  # a psycopg connection, blocking or asyncio
    since: float
    ask_at: float  # when to ask its server (again, if it answered: a long statement)


@dataclass(frozen=True, slots=True)
class _Dial:
    """How to reach the server of a connection again: its connection string, and its
    host's address when the string gives ``hostaddr``."""

    conninfo: str
    hostaddr: str | None


@dataclass(slots=True)
class _Silent:
    since: float  # when its oldest unanswered statement was sent
    said_at: float
    dial: _Dial  # kept: its connections are cut and closed, a probe still dials it
    next_look: float = 0.0


@dataclass(slots=True)
class _Watch:
    lock: threading.Lock = field(default_factory=threading.Lock)
    flights: dict[int, _Flight] = field(default_factory=dict)
    # Each connection's connection string (the parts', weakly): what a probe dials.
    conninfo: weakref.WeakKeyDictionary[Any, str] = field(
        default_factory=weakref.WeakKeyDictionary)
    silent: dict[tuple[str, str], _Silent] = field(default_factory=dict)
    thread: threading.Thread | None = None


_watch = _Watch()
_tokens = itertools.count(1)


def known(conn: Any, conninfo: str) -> None:
    """``conn`` was opened from ``conninfo``: its statements may be watched."""
    with _watch.lock:
        _watch.conninfo[conn] = conninfo
        if _watch.thread is None:
            _watch.thread = threading.Thread(target=_look_forever, name="outbox-hang-watch",
                                             daemon=True)
            _watch.thread.start()


def begin(conn: Any) -> int:
    """A statement on ``conn`` was sent: watched until ``end`` (its token)."""
    token = next(_tokens)
    now = time.monotonic()
    flight = _Flight(conn, now, now + HANG_AFTER)
    with _watch.lock:
        _watch.flights[token] = flight
    return token


def end(token: int) -> None:
    """The statement of ``token`` was answered (or failed); 0: none was begun."""
    with _watch.lock:
        _watch.flights.pop(token, None)


@contextlib.contextmanager
def watching(conn: Any) -> Any:
    """``begin`` and ``end`` around a block."""
    token = begin(conn)
    try:
        yield
    finally:
        end(token)


def _look_forever() -> None:
    """The watch's thread: looks until no dispatcher connection is open and no host is
    being asked again (a process that stopped dispatching keeps no thread for it); the
    next connection opened starts it again."""
    while True:
        time.sleep(LOOK_EVERY)
        with contextlib.suppress(Exception):  # a failed look is not the watch's end
            look(time.monotonic())
        with _watch.lock:
            if not _watch.silent and all(c.closed for c in list(_watch.conninfo)):
                _watch.thread = None
                return


def look(now: float) -> None:
    """One look: ask the host of every statement waiting ``HANG_AFTER``; cut and say a
    host that does not answer; ask again the hosts said, and say when they answer."""
    with _watch.lock:
        waiting = [f for f in _watch.flights.values() if f.ask_at <= now]
        due = [(host, silent) for host, silent in _watch.silent.items()
               if silent.next_look <= now]
    asked: dict[tuple[str, str], bool] = {}
    for flight in waiting:
        where = _where(flight.conn)
        dial = _dial(flight.conn)
        if where is None or dial is None or where in _watch.silent:
            continue  # said already: its connections were cut, this one opened since
        if where not in asked:
            asked[where] = _answers(dial, where) != "silent"
        if asked[where] or not _waiting(flight):
            flight.ask_at = now + ASK_AGAIN  # answered meanwhile: the server is there
        else:
            _said_silent(where, flight.since, dial)
    for where, silent in due:
        _look_again(where, silent)


def _waiting(flight: _Flight) -> bool:
    """Whether ``flight``'s statement still waits for its answer."""
    with _watch.lock:
        return any(f is flight for f in _watch.flights.values())


def _said_silent(where: tuple[str, str], since: float, dial: _Dial) -> None:
    now = time.monotonic()
    with _watch.lock:
        if where in _watch.silent:
            return
        _watch.silent[where] = _Silent(since, now, dial, now + REPROBE)
    cut = sever(where)
    log.error(
        "the database at host %s port %s has not answered for %.0f s (a frozen server or "
        "a network partition?): %d dispatcher connection(s) to it cut; each part "
        "reconnects with backoff until it answers again, or a failover gives another host "
        "(list every host in the DSN with target_session_attrs=read-write)",
        where[0], where[1], now - since, cut)


def _look_again(where: tuple[str, str], silent: _Silent) -> None:
    answer = _answers(silent.dial, where)
    now = time.monotonic()
    if answer == "answered":
        log.warning("the database at host %s port %s answers again, %.0f s after it "
                    "stopped", where[0], where[1], now - silent.since)
    if answer == "silent" and now - silent.said_at < FORGET:
        silent.next_look = now + REPROBE
        return
    with _watch.lock:
        _watch.silent.pop(where, None)


def _where(conn: Any) -> tuple[str, str] | None:
    with contextlib.suppress(Exception):
        info = conn.info
        return (str(info.host), str(info.port))
    return None


def _dial(conn: Any) -> _Dial | None:
    """How ``conn`` was dialled (None: not a connection of ours, or gone)."""
    with _watch.lock:
        conninfo = _watch.conninfo.get(conn)
    if conninfo is None:
        return None
    hostaddr = None
    with contextlib.suppress(Exception):
        if "hostaddr" in conninfo_to_dict(conninfo):
            hostaddr = str(conn.info.hostaddr)
    return _Dial(conninfo, hostaddr)


def _answers(dial: _Dial, where: tuple[str, str]) -> str:
    """Ask ``where`` for ``SELECT 1`` on a fresh connection dialled as ``dial`` says:
    ``answered``, ``refused`` (an error soon: the server or its host is down, which the
    parts' own connections say) or ``silent`` (no answer within ``PROBE_TIMEOUT``)."""
    result: list[str] = []
    probe = threading.Thread(target=_probe, args=(dial, where, result),
                             name="outbox-hang-probe", daemon=True)
    probe.start()
    probe.join(PROBE_TIMEOUT + 0.5)  # a connect that hangs past its own timeout too
    return result[0] if result else "silent"


def _probe(dial: _Dial, where: tuple[str, str], result: list[str]) -> None:
    started = time.monotonic()
    options: dict[str, Any] = {"host": where[0], "port": where[1],
                               "connect_timeout": PROBE_TIMEOUT,
                               "target_session_attrs": "any", "autocommit": True,
                               "application_name": "outbox hang probe"}
    if dial.hostaddr is not None:
        options["hostaddr"] = dial.hostaddr
    try:
        with psycopg.connect(dial.conninfo, **options) as probe:
            probe.execute("SELECT 1")
    except psycopg.Error:
        late = time.monotonic() - started >= PROBE_TIMEOUT - 0.5
        result.append("silent" if late else "refused")
        return
    result.append("answered")


def sever(where: tuple[str, str]) -> int:
    """Shut down the socket of every open dispatcher connection to ``where``; how many."""
    with _watch.lock:
        conns = [c for c in _watch.conninfo if not c.closed]
    return sum(1 for conn in conns if _where(conn) == where and cut(conn))


def cut(conn: Any) -> bool:
    """Shut down ``conn``'s socket (``shutdown(2)``: the descriptor stays psycopg's, to
    close): what waits on it fails at once as a lost connection. Whether it was cut.
    (A stop's cuts too: ``severance``.)"""
    with contextlib.suppress(OSError, psycopg.Error, ValueError):
        with socket.socket(fileno=os.dup(conn.pgconn.socket)) as sock:
            sock.shutdown(socket.SHUT_RDWR)
        return True
    return False
