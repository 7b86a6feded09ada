"""Every connection a dispatcher opens gets timeouts and keepalives, and a connection
string's own parameters win over them.

Read back from the kernel (the sockets' TCP options) and from libpq (the connection's
parameters), on a running fleet dispatcher: its scout, its target's claimer, listener and
recorder, and the limits home; and a plain dispatcher's listener.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
from collections.abc import Iterator

import psutil
import pytest

import outbox
from outbox import Dispatcher, Effect, Job, Limit, Target

from .support import Node, Pair, pair, wait_until

OWN = ("connect_timeout=3 keepalives_idle=30 keepalives_interval=7 keepalives_count=4 "
       "tcp_user_timeout=4000")


@pytest.fixture(scope="module")
def servers() -> Iterator[Pair]:
    with pair() as made:
        yield made


def _tcp_options(fd: int) -> dict[str, int]:
    with socket.socket(fileno=os.dup(fd)) as sock:
        return {
            "keepalives": sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
            "keepalives_idle": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
            "keepalives_interval": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
            "keepalives_count": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
            "tcp_user_timeout": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
        }


def _sockets_by_name(node: Node) -> dict[str, list[dict[str, int]]]:
    """This process's TCP connections to ``node``, by the application_name the server
    knows them by, with the socket options the kernel holds for each."""
    with node.connect() as conn:
        names = dict(conn.execute(
            "SELECT client_port, application_name FROM pg_stat_activity"
            " WHERE client_port IS NOT NULL AND pid <> pg_backend_pid()").fetchall())
    found: dict[str, list[dict[str, int]]] = {}
    for link in psutil.Process().net_connections(kind="tcp"):
        if link.raddr and link.raddr.port == node.port and link.laddr.port in names:
            name = " ".join(names[link.laddr.port].split()[:2])  # "outbox claimer"
            found.setdefault(name, []).append(_tcp_options(link.fd))
    return found


class Shared(Effect):
    name = "shared.effect"

    def perform(self, job: Job) -> None:
        return None


def test_every_dispatcher_connection_has_its_timeouts_and_the_dsn_wins(
        servers: Pair) -> None:
    primary = servers.primary
    with primary.connect() as conn:
        outbox.migrate(conn, schema="tenant")
        outbox.migrate(conn, schema="home")
        outbox.migrate(conn, schema="plain")
        with outbox.transaction(conn, schema="tenant") as tx:
            tx.enqueue("shared.effect", key="k-1", payload={})
    target = Target(f"{primary.dsn} {OWN}", "tenant")  # the DSN sets its own
    home = Target(primary.dsn, "home")  # this one leaves them to the dispatcher
    dispatcher = Dispatcher(effects=[Shared()], targets=[target], limits_home=home,
                            limits={"shared.effect": Limit(rate=100.0, shared=True)},
                            poll_interval=0.2)
    # A fleet has no listener of its own (its scout listens): a plain dispatcher has.
    plain = Dispatcher(f"{primary.dsn} {OWN}", effects=[Shared()], schema="plain")
    runner = threading.Thread(target=dispatcher.run)
    runner.start()
    other = threading.Thread(target=plain.run)
    other.start()
    try:
        wanted = {"outbox claimer", "outbox recorder", "outbox listener", "outbox scout",
                  "outbox limits"}
        sockets: dict[str, list[dict[str, int]]] = {}
        keys = itertools.count(2)

        def all_open() -> bool:  # a fleet's engines connect for their turns only
            for name, seen in _sockets_by_name(primary).items():
                sockets.setdefault(name, []).extend(seen)
            with primary.connect() as conn:  # work, so that recorders record
                for schema in ("tenant", "plain"):
                    with outbox.transaction(conn, schema=schema) as tx:
                        tx.enqueue("shared.effect", key=f"k-{next(keys)}", payload={})
            return wanted <= set(sockets)

        try:
            wait_until(all_open, 30, f"the dispatcher's connections {wanted}")
        except AssertionError:
            raise AssertionError(f"seen {sorted(sockets)}") from None
    finally:
        dispatcher.stop()
        plain.stop()
        runner.join(60)
        other.join(60)
    assert not runner.is_alive() and not other.is_alive()
    own = {"keepalives": 1, "keepalives_idle": 30, "keepalives_interval": 7,
           "keepalives_count": 4, "tcp_user_timeout": 4000}
    for name in wanted - {"outbox limits"}:
        assert sockets[name] == [own] * len(sockets[name]), name
    # The home's DSN says nothing: the home's defaults (a shorter tcp_user_timeout).
    home_options = {"keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2,
                    "keepalives_count": 2, "tcp_user_timeout": 5000}
    assert sockets["outbox limits"] == [home_options] * len(sockets["outbox limits"])
