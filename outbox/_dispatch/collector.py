"""Pauses of Python's cyclic garbage collector around a dispatcher's bursts of
allocation.

A dispatcher makes objects in bursts: a claim turns thousands of rows into held jobs
(several container objects each), a chunk of hooks makes each hook's cursor and
transaction objects. Every 700 or so containers made and still alive, the collector
walks the young ones; every tenth such walk, the older ones too; now and then every
object of the process. Those walks are most of what the burst costs beyond its own
work (measured: the claimer's 2,000-job claim, 136 young collections and 12 older ones
per 20,000 jobs; paused, 15 and 1, and the client's CPU a job about a tenth less;
docs/explanation/performance.md). Paused, the burst's objects are walked once, by the
first collection after it, and those that died meanwhile not at all.

The pauses are short and bounded: a claim's rows made into jobs (Python work alone, no
statement waited for under it); a chunk's hooks, at most ``HOOKED_CHUNK_MAX``, their
statements answered in one pipeline, within half a heartbeat interval. Cycles made
meanwhile, anywhere in the process, are collected after, as they would have been.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["CollectorPause", "collection_paused"]


class CollectorPause:
    """The collector off while any pause is in force. The collector is process-wide and
    several claimers and recorders may share a process (dispatchers side by side, a
    fleet): the pauses are counted under a lock, the first turns it off if it was on and
    the last turns it back on, so one pause's end never re-enables it under another's,
    and a collector that was off (the application's choice) is left off."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pausing = 0
        self._was_enabled = False

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._pausing == 0:
                self._was_enabled = gc.isenabled()
                if self._was_enabled:
                    gc.disable()
            self._pausing += 1
        try:
            yield
        finally:
            with self._lock:
                self._pausing -= 1
                if self._pausing == 0 and self._was_enabled:
                    gc.enable()


collection_paused = CollectorPause()
