"""Resident set size of a process, from /proc (Linux); 0 where it cannot be read."""

from __future__ import annotations


def _status_kib(pid: int | str, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def rss(pid: int | str = "self") -> int:
    """Current resident set size in bytes (VmRSS)."""
    return _status_kib(pid, "VmRSS") * 1024


def peak_rss(pid: int | str = "self") -> int:
    """Peak resident set size in bytes over the process's life (VmHWM)."""
    return _status_kib(pid, "VmHWM") * 1024


def pss(pid: int | str = "self") -> int:
    """Proportional set size in bytes (pages shared with other processes, a forkserver's
    say, divided among them), from smaps_rollup; 0 where it cannot be read."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as rollup:
            for line in rollup:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0
