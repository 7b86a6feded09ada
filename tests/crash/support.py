"""Helpers for the crash tests: awaited conditions, worker subprocesses, database views.

Nothing here sleeps in place of synchronisation: ``wait_until`` polls a condition (a row,
a backend state, a process state) with a deadline, and fails naming what it waited for.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psycopg
from psycopg import sql

import outbox
from outbox import Dispatcher, DispatchStats, NewJob
from outbox.sql import notify_channel
from outbox.testing import jobs

from .provider import EFFECT, Conn, TableEffect

T = TypeVar("T")
Stats = dict[str, float]  # DispatchStats.as_dict() as a worker printed it

REPO = Path(__file__).resolve().parents[2]
DSN_VARIABLE = "OUTBOX_DATABASE_URL"


def wait_until(predicate: Callable[[], object], what: str, timeout: float = 30.0) -> None:
    """Poll ``predicate`` until it is truthy; fail naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.02)


def poll_for(produce: Callable[[], T | None], what: str, timeout: float = 30.0) -> T:
    """Poll ``produce`` until it returns something other than None, and return that."""
    found: list[T] = []

    def produced() -> bool:
        value = produce()
        if value is not None:
            found.append(value)
        return bool(found)

    wait_until(produced, what, timeout)
    return found[0]


def table(schema: str, name: str) -> sql.Composed:
    """``schema.name``, both quoted."""
    return sql.SQL("{}.{}").format(sql.Identifier(schema), sql.Identifier(name))


def connect(dsn: str) -> Conn:
    """An autocommit connection for observing and steering from the test."""
    return psycopg.connect(dsn, autocommit=True, application_name="crash test")


# -- the database, as the tests see it ------------------------------------------------------


def job(conn: Conn, schema: str, key: str) -> dict[str, Any]:
    """One job's columns (it must exist)."""
    return jobs(conn, schema, key=key)[key]


def status_counts(conn: Conn, schema: str) -> dict[str, int]:
    """Jobs per status."""
    rows = conn.execute(sql.SQL("SELECT status, count(*) FROM {} GROUP BY status").format(
        table(schema, "jobs"))).fetchall()
    return {status: count for status, count in rows}


def count_done(conn: Conn, schema: str) -> int:
    """How many jobs are done."""
    return status_counts(conn, schema).get("done", 0)


def lease_expired(conn: Conn, schema: str, key: str) -> bool:
    """Whether the job is running on a lease that has run out."""
    row = conn.execute(
        sql.SQL("SELECT status = 'running' AND lease_until < now() FROM {} WHERE key = %s")
        .format(table(schema, "jobs")), (key,)).fetchone()
    return bool(row and row[0])


def backend_gone(conn: Conn, pid: int) -> bool:
    """Whether the server backend ``pid`` has exited."""
    row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
    return row is not None and row[0] == 0


def waiting_on_lock(conn: Conn, pid: int) -> bool:
    """Whether backend ``pid`` is blocked waiting for a (row or table) lock."""
    row = conn.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s",
                       (pid,)).fetchone()
    return row is not None and row[0] == "Lock"


def dispatcher_backends(conn: Conn, schema: str, role: str | None = None) -> list[int]:
    """Backend pids of dispatcher connections (claimer, recorder, listener) that serve
    ``schema``: their last statement names the schema or its notification channel."""
    rows = conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
        " AND application_name LIKE ANY(%(names)s)"
        " AND (position(%(schema)s in query) > 0 OR position(%(channel)s in query) > 0)",
        {"names": [f"outbox {role} %"] if role else ["outbox claimer %", "outbox recorder %",
                                                       "outbox listener %"],
         "schema": f'"{schema}"', "channel": notify_channel(schema)},
    ).fetchall()
    return [pid for (pid,) in rows]


def enqueue(conn: Conn, schema: str, keys: Iterable[str], payload: Mapping[str, Any] | None = None,
            effect: str = EFFECT) -> None:
    """Enqueue one job per key, all in one committed business transaction."""
    with outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue_many(NewJob(effect, key, dict(payload or {})) for key in keys)


def drain(dsn: str, schema: str, *, lease: float = 1.0, timeout: float = 60.0) -> DispatchStats:
    """Run an in-process dispatcher (the rescuer) with the table effect until idle."""
    effect = TableEffect(dsn, schema)
    try:
        return Dispatcher(dsn, [effect], schema=schema, lease=lease,
                          rescue_interval=0.1).run_until_idle(timeout=timeout)
    finally:
        effect.close()


def process_stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped by a signal (state T in /proc)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")


# -- worker subprocesses ------------------------------------------------------------------


@dataclass
class Worker:
    """A ``tests.crash.worker`` subprocess; its log (stderr) goes to ``log_path``."""

    proc: subprocess.Popen[bytes]
    log_path: Path
    _buffer: bytes = field(default=b"")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_log(self, needle: str, timeout: float = 30.0) -> None:
        """Wait until the worker has logged ``needle``."""
        wait_until(lambda: needle in self.log(), f"worker {self.pid} to log {needle!r}", timeout)

    def read_json_line(self, timeout: float = 30.0) -> dict[str, Any]:
        """The next line the worker prints on stdout, as JSON, within ``timeout``."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(left):
                    raise AssertionError(f"worker {self.pid} printed no line in {timeout}s:\n"
                                         + self.log())
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    raise AssertionError(f"worker {self.pid} exited early:\n{self.log()}")
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        result: dict[str, Any] = json.loads(line)
        return result

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def kill(self) -> None:
        """kill -9, and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)

    def finish(self, timeout: float = 60.0) -> Stats:
        """Wait for a clean exit; return the dispatcher stats the worker printed last."""
        out, _ = self.proc.communicate(timeout=timeout)
        assert self.proc.returncode == 0, f"worker exited {self.proc.returncode}:\n{self.log()}"
        lines = [ln for ln in (self._buffer + out).decode().splitlines() if ln.strip()]
        stats: Stats = json.loads(lines[-1])
        return stats

    def stop(self, timeout: float = 60.0) -> Stats:
        """SIGTERM (graceful stop) and ``finish``."""
        self.signal(signal.SIGTERM)
        return self.finish(timeout)

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # SIGKILL also ends a SIGSTOPped process
        self.proc.wait(timeout=30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class Workers:
    """Starts worker subprocesses and guarantees they are killed when the test ends."""

    def __init__(self, dsn: str, schema: str, log_dir: Path) -> None:
        self.dsn = dsn
        self.schema = schema
        self._log_dir = log_dir
        self._started: list[Worker] = []

    def start(self, mode: str = "run", *, dsn: str | None = None, schema: str | None = None,
              lease: float = 1.0, concurrency: int = 4, **options: float | str) -> Worker:
        """Start ``python -m tests.crash.worker MODE``; see that module for the options."""
        args = [sys.executable, "-m", "tests.crash.worker", mode,
                "--schema", schema or self.schema, "--lease", str(lease),
                "--concurrency", str(concurrency)]
        for name, value in options.items():
            args += [f"--{name.replace('_', '-')}", str(value)]
        env = dict(os.environ)
        env[DSN_VARIABLE] = dsn or self.dsn
        env.setdefault("XDG_RUNTIME_DIR", str(REPO / ".runtime"))
        log_path = self._log_dir / f"worker-{len(self._started)}.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log,
                                    stdin=subprocess.DEVNULL)
        worker = Worker(proc, log_path)
        self._started.append(worker)
        return worker

    def cleanup(self) -> None:
        for worker in self._started:
            worker.cleanup()


@contextmanager
def session(dsn: str) -> Iterator[Conn]:
    """A non-autocommit connection whose open transaction is rolled back on exit."""
    conn = psycopg.connect(dsn, application_name="crash session")
    try:
        yield conn
    finally:
        conn.rollback()
        conn.close()
