"""Two transactions enqueue one key through ``<schema>.enqueue`` at once, on real
connections: the second waits for the first and then finds its job, makes its own if the
first rolled back, or is refused if it asked for another payload."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import psycopg
import pytest

from outbox.sql import enqueue_error
from outbox.testing import jobs

from ..integration.helpers import wait_until
from .support import sql_enqueue


def _waiting_on_a_lock(dsn: str, pid: int) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s",
                           (pid,)).fetchone()
    return row == ("Lock",)


def _race(dsn: str, schema: str, second_payload: dict[str, Any], *, first_commits: bool,
          isolation: psycopg.IsolationLevel | None = None) -> tuple[int, Future[int | None]]:
    """The first transaction enqueues and holds; the second enqueues the same key in a
    thread and is seen waiting; then the first commits or rolls back. The first's job id
    and the second's outcome (committed when it succeeds)."""
    with psycopg.connect(dsn) as first, psycopg.connect(dsn) as second, \
            ThreadPoolExecutor(1) as pool:
        if isolation is not None:
            second.isolation_level = isolation
            second.execute("SELECT 1")  # the snapshot is taken before the first commits
        made = sql_enqueue(first, schema, "email.send", "race", {"n": 1})
        assert made is not None

        def enqueue_second() -> int | None:
            found = sql_enqueue(second, schema, "email.send", "race", second_payload)
            second.commit()
            return found

        outcome = pool.submit(enqueue_second)
        wait_until(lambda: _waiting_on_a_lock(dsn, second.info.backend_pid), timeout=30,
                   what="the second enqueue waiting for the first transaction")
        assert not outcome.done()
        first.commit() if first_commits else first.rollback()
        outcome.exception(timeout=30)
        return made, outcome


def test_the_second_finds_the_first_job_once_it_commits(dsn: str, schema: str) -> None:
    made, outcome = _race(dsn, schema, {"n": 1}, first_commits=True)
    assert outcome.result() == made
    assert [job["id"] for job in jobs(dsn, schema).values()] == [made]


def test_the_second_makes_the_job_when_the_first_rolls_back(dsn: str, schema: str) -> None:
    made, outcome = _race(dsn, schema, {"n": 2}, first_commits=False)
    second = outcome.result()
    assert second is not None and second != made
    assert [(job["id"], job["payload"]) for job in jobs(dsn, schema).values()] == [
        (second, {"n": 2})]


def test_the_second_is_refused_when_it_asked_for_another_payload(dsn: str,
                                                                 schema: str) -> None:
    made, outcome = _race(dsn, schema, {"n": 2}, first_commits=True)
    with pytest.raises(psycopg.Error) as raised:
        outcome.result()
    diag = raised.value.diag
    error = enqueue_error(diag.sqlstate, diag.message_primary or "", diag.message_detail)
    assert error is not None and type(error).__name__ == "IdempotencyKeyConflict"
    assert [job["id"] for job in jobs(dsn, schema).values()] == [made]


def test_under_repeatable_read_the_second_is_asked_to_retry(dsn: str, schema: str) -> None:
    """Its snapshot cannot see the first's job: a serialization failure (40001), which a
    REPEATABLE READ caller retries anyway, never a second job."""
    made, outcome = _race(dsn, schema, {"n": 1}, first_commits=True,
                          isolation=psycopg.IsolationLevel.REPEATABLE_READ)
    with pytest.raises(psycopg.errors.SerializationFailure):
        outcome.result()
    assert [job["id"] for job in jobs(dsn, schema).values()] == [made]
