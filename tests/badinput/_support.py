"""What the bad-input tests share: a trivial effect, enqueue and read-back helpers."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import psycopg

import outbox
from outbox import Effect, Job
from outbox.testing import jobs, ledger

__all__ = ["Scripted", "enqueue", "keys"]


class Scripted(Effect):
    """``test.bad``: runs ``behaviour(job)`` and counts calls per key."""

    name = "test.bad"

    def __init__(self, behaviour: Callable[[Job], Any]) -> None:
        self._behaviour = behaviour
        self._lock = threading.Lock()
        self.calls: Counter[str] = Counter()

    def perform(self, job: Job) -> Any:
        with self._lock:
            self.calls[job.key] += 1
        return self._behaviour(job)


def enqueue(dsn: str, schema: str, key: str, payload: dict[str, Any], **options: Any) -> int:
    """Enqueue one ``test.bad`` job (committed) and return its id."""
    effect = options.pop("effect", "test.bad")
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        result = tx.enqueue(effect, key=key, payload=payload, **options)
    assert result.created and result.job_id is not None
    return result.job_id


def keys(dsn: str, schema: str) -> set[str]:
    """The keys of every job and every ledger row: what enqueue has written."""
    return set(jobs(dsn, schema)) | set(ledger(dsn, schema))
