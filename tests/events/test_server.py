"""The test broker's own faults: a frozen server answers nothing until thawed."""

from __future__ import annotations

from pathlib import Path

from effects.testing import NatsServer

from .support import add_stream, stored_count


def thread_states(pid: int) -> set[str]:
    """The scheduler state of each thread of ``pid`` (``T`` = stopped by a signal)."""
    states = set()
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        # "pid (comm) S ...": the state follows the last ')' (comm may hold spaces).
        states.add(stat.read_text().rsplit(")", 1)[1].split()[0])
    return states


def test_freeze_returns_once_every_thread_has_stopped_and_thaw_resumes() -> None:
    with NatsServer() as server:
        name = add_stream(server.url)
        assert server.pid is not None

        server.freeze()
        frozen = thread_states(server.pid)
        server.thaw()

        assert frozen == {"T"}
        assert server.running
        assert stored_count(server.url, name) == 0  # answers again
