"""A PgBouncer in transaction-pooling mode in front of the test server, for the tests.

Debian's ``pgbouncer`` binary (1.18 on Debian 12: no prepared-statement support) listens
on a free loopback port with fewer server connections than clients, so that clients
share server sessions the way they do in production.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

INSTALL_HINT = "pgbouncer is not installed: apt-get install -y pgbouncer"
POOL_SIZE = 2
# When run as root, pgbouncer must switch to another user; the embedded server's own user
# can also reach its socket directory.
SERVER_OS_USER = "embedded_postgres"


def binary() -> str | None:
    return shutil.which("pgbouncer") or next(
        (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if Path(p).exists()), None)


def require_binary() -> str:
    found = binary()
    if found is None:
        pytest.skip(INSTALL_HINT)
    return found


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class PgBouncer:
    """A running pgbouncer: ``dsn`` goes through it, ``direct`` to the server."""

    proc: subprocess.Popen[bytes]
    workdir: Path
    dsn: str
    direct: str

    def log(self) -> str:
        path = self.workdir / "pgbouncer.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        shutil.rmtree(self.workdir, ignore_errors=True)


def start(direct: str, *, pool_size: int = POOL_SIZE) -> PgBouncer:
    """Start pgbouncer (transaction pooling, ``pool_size`` server connections) in front of
    the server at ``direct``; return once it accepts connections."""
    executable = require_binary()
    server = conninfo_to_dict(direct)
    user = str(server.get("user") or "postgres")
    dbname = str(server.get("dbname") or user)
    target = {k: v for k, v in server.items() if k in ("host", "port", "user", "password")}
    workdir = Path(tempfile.mkdtemp(prefix="outbox-pgbouncer-"))
    workdir.chmod(0o755)
    port = _free_port()
    as_root = os.geteuid() == 0
    config = "\n".join([
        "[databases]",
        "* = " + " ".join(f"{k}={v}" for k, v in target.items()),
        "[pgbouncer]",
        "listen_addr = 127.0.0.1",
        f"listen_port = {port}",
        "unix_socket_dir =",
        "auth_type = trust",
        f"auth_file = {workdir / 'userlist.txt'}",
        "pool_mode = transaction",
        f"default_pool_size = {pool_size}",
        "min_pool_size = 0",
        "reserve_pool_size = 0",
        "max_client_conn = 200",
        f"logfile = {workdir / 'pgbouncer.log'}",
        f"pidfile = {workdir / 'pgbouncer.pid'}",
        *([f"user = {SERVER_OS_USER}"] if as_root else []),
        "",
    ])
    (workdir / "pgbouncer.ini").write_text(config)
    (workdir / "userlist.txt").write_text(f'"{user}" ""\n')
    if as_root:
        owner = pwd.getpwnam(SERVER_OS_USER)
        for path in (workdir, *workdir.iterdir()):
            os.chown(path, owner.pw_uid, owner.pw_gid)
    proc = subprocess.Popen([executable, str(workdir / "pgbouncer.ini")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    bouncer = PgBouncer(proc, workdir, make_conninfo(
        "", host="127.0.0.1", port=port, dbname=dbname, user=user), direct)
    _wait_ready(bouncer)
    return bouncer


def _wait_ready(bouncer: PgBouncer, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if bouncer.proc.poll() is not None:
            raise RuntimeError(f"pgbouncer exited {bouncer.proc.returncode}:\n{bouncer.log()}")
        try:
            with psycopg.connect(bouncer.dsn, connect_timeout=2, prepare_threshold=None) as conn:
                conn.execute("SELECT 1")
            return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                bouncer.stop()
                raise
            time.sleep(0.05)  # polling a port that is not open yet: there is no event
