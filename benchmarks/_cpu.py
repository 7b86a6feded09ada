"""CPU time spent by the PostgreSQL server, read from ``/proc``.

A rate says how fast a system drained on this machine; CPU time per job says what each
job cost, which carries to another machine: a system whose every job costs twice the
probe's CPU can drain at most half as fast as the probe wherever the CPUs are the limit.

The server's CPU is the postmaster's and its children's (backends, autovacuum, the WAL
writer, the checkpointer): the postmaster's own and its reaped children's times, plus
each live child's. A backend that exits between two samples is counted once: live in the
first, reaped (in the postmaster's children's times) or still a zombie in the second, as
long as the children are read while none is reaped (``ServerCpu.seconds`` reads again
until so).
Only a server on this machine, whose processes this user may read, can be measured;
elsewhere ``ServerCpu.of`` gives None and the figures are left out.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import psycopg

_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")
_PROC = Path("/proc")
# Fields of /proc/<pid>/stat after the command's closing parenthesis, from 0 (field 3,
# the state): the parent's pid and the user, system, children's user and children's
# system times, in clock ticks.
_PPID, _UTIME, _STIME, _CUTIME, _CSTIME = 1, 11, 12, 13, 14
_READS = 100  # at most, for one steady reading


def _stat(pid: int) -> list[str] | None:
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: the fields start after the last.
    return text[text.rindex(")") + 2:].split()


def _ticks(fields: list[str], *which: int) -> int:
    return sum(int(fields[i]) for i in which)


@dataclass(frozen=True)
class ServerCpu:
    """The CPU seconds used so far by the server whose postmaster is ``postmaster``."""

    postmaster: int

    @classmethod
    def of(cls, dsn: str) -> ServerCpu | None:
        """The server ``dsn`` reaches, when its processes can be read here; else None."""
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute("SELECT pg_backend_pid()").fetchone()
            # Read while connected: the backend exits when the connection closes.
            backend = _stat(int(row[0])) if row else None
        if backend is None:
            return None
        postmaster = int(backend[_PPID])
        return cls(postmaster) if _stat(postmaster) is not None else None

    def seconds(self) -> float:
        """CPU seconds of the postmaster and all its children, reaped or alive."""
        # A child reaped while the children are read would be counted twice or not at
        # all: read again until the reaped children's times did not move meanwhile.
        for _ in range(_READS):
            before = self._own()
            children = 0
            for entry in _PROC.iterdir():
                if entry.name.isdigit():
                    fields = _stat(int(entry.name))
                    if fields is not None and int(fields[_PPID]) == self.postmaster:
                        children += _ticks(fields, _UTIME, _STIME)
            after = self._own()
            if _ticks(after, _CUTIME, _CSTIME) == _ticks(before, _CUTIME, _CSTIME):
                return (children + _ticks(after, _UTIME, _STIME, _CUTIME, _CSTIME)
                        ) / _TICKS_PER_SECOND
        raise RuntimeError(f"the server's children kept exiting: no steady reading in "
                           f"{_READS} tries")

    def _own(self) -> list[str]:
        fields = _stat(self.postmaster)
        if fields is None:
            raise RuntimeError(f"the server's postmaster (pid {self.postmaster}) is gone")
        return fields


def process_seconds(pid: int) -> float:
    """Seconds on a CPU of process ``pid`` (one backend), by the scheduler's own count
    (``/proc/<pid>/schedstat``, in nanoseconds: fine enough for a few statements, where
    the clock ticks of ``/proc/<pid>/stat`` are not)."""
    with open(f"/proc/{pid}/schedstat", encoding="ascii") as f:
        return int(f.read().split()[0]) / 1e9


def wait_for_clients_to_leave(dsn: str, timeout: float = 10.0) -> None:
    """Return once no other client is connected to the database of ``dsn`` (a worker's
    backends exit after its connections close): their CPU is then all counted."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(dsn, autocommit=True) as conn:
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                "   AND backend_type = 'client backend'").fetchone()
            if row is not None and row[0] == 0:
                return
            time.sleep(0.01)
