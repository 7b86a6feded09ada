"""The harness of the broker crash tests' worker processes (``tests.<broker>.worker``).

A worker is a dispatcher or an inbox consumer in a process of its own, so that a test can
kill -9 it at a chosen moment. It tells the test what it did by printing one JSON object
a line (``report``), then waits to be killed (``hang`` on a loop, ``block`` in a thread).
Every worker has a ``drain`` mode: a ``Dispatcher`` running ``run_until_idle`` over the
same database, which prints its stats. ``start`` launches a worker from a test; the
database comes from ``$OUTBOX_DATABASE_URL``, as ``database_url()`` reads it.

A broker's worker module gives its modes and its own arguments to ``main``::

    main({"drain": drain_mode, "hang-after-publish": ...}, add_nats_arguments)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn

import outbox
from tests.crash.support import DSN_VARIABLE, REPO, Worker

__all__ = ["Mode", "block", "database_url", "drain", "hang", "main", "report", "start"]

Mode = Callable[[argparse.Namespace], None]
"""What a worker does in one mode, given its parsed arguments."""


def database_url() -> str:
    """The worker's database, as the test gave it."""
    return os.environ[DSN_VARIABLE]


def report(message: Mapping[str, Any]) -> None:
    """One JSON line on stdout, flushed: the test reads it with ``read_json_line``."""
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


async def hang() -> NoReturn:
    """Wait on the loop until the process is killed."""
    await asyncio.Event().wait()
    raise AssertionError("unreachable: nothing sets the event")


def block() -> NoReturn:
    """Wait in this thread until the process is killed."""
    threading.Event().wait()
    raise AssertionError("unreachable: nothing sets the event")


def drain(effect: outbox.Effect, close: Callable[[], None], args: argparse.Namespace) -> None:
    """Run a ``Dispatcher`` with ``effect`` until no job is left; report its stats.

    Short lease, rescue interval and backoff: a job a killed worker held is rescued and
    retried within seconds.
    """
    dispatcher = outbox.Dispatcher(
        database_url(), [effect], schema=args.schema, lease=args.lease,
        rescue_interval=0.1, poll_interval=0.05, backoff=outbox.Backoff(base=0.05, cap=0.5),
    )
    try:
        stats = dispatcher.run_until_idle(timeout=120)
    finally:
        close()
    report(stats.as_dict())


def main(modes: Mapping[str, Mode],
         add_arguments: Callable[[argparse.ArgumentParser], None]) -> None:
    """Parse ``MODE --schema S [--lease L]`` and the broker's own arguments; run MODE."""
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=sorted(modes))
    parser.add_argument("--schema", required=True)
    parser.add_argument("--lease", type=float, default=1.0)
    add_arguments(parser)
    args = parser.parse_args()
    modes[args.mode](args)


def start(module: str, mode: str, dsn: str, log_dir: Path, *arguments: str) -> Worker:
    """Start ``python -m module mode *arguments`` on database ``dsn``; its stderr goes to
    ``log_dir/worker-<mode>.log``, its stdout is read through the returned ``Worker``."""
    env = dict(os.environ, **{DSN_VARIABLE: dsn})
    env.setdefault("XDG_RUNTIME_DIR", str(REPO / ".runtime"))
    log_path = log_dir / f"worker-{mode}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, mode, *arguments],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
        )
    return Worker(proc, log_path)
