"""What the schedules' tests share: an effect that records the jobs it performs."""

from __future__ import annotations

import threading
from typing import Any

import outbox

EFFECT = "sched.record"


class Recording(outbox.Effect):
    """Records every job it performs (thread-safe), and wakes whoever waits for more."""

    name = EFFECT

    def __init__(self) -> None:
        self.jobs: list[outbox.Job] = []
        self.changed = threading.Condition()

    def perform(self, job: outbox.Job) -> dict[str, Any]:
        with self.changed:
            self.jobs.append(job)
            self.changed.notify_all()
        return {"slot": None if job.scheduled_for is None else job.scheduled_for.isoformat()}

    def wait_for(self, count: int, timeout: float = 60.0) -> list[outbox.Job]:
        """The jobs performed once there are at least ``count``; fails after ``timeout``."""
        with self.changed:
            if not self.changed.wait_for(lambda: len(self.jobs) >= count, timeout):
                raise AssertionError(f"{len(self.jobs)} jobs performed in {timeout}s, "
                                     f"expected {count}")
            return list(self.jobs)
