"""A running perform is told to stop (job.cancelled): by outbox cancel, by its claim
taken over, by its effect's timeout; and a stuck perform does not hold a stop."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner

import outbox
from outbox.cli import main
from outbox.errors import ConfigurationError

from ..integration.helpers import fetch, table, wait_until

TOLD_WITHIN = 3.0  # a behaviour deadline with margin for a loaded machine, not a speed


class Stepper(outbox.Effect):
    """Works in 0.1 s steps, checking job.cancelled before each one."""

    name = "work.steps"

    def __init__(self) -> None:
        self.started = threading.Event()
        self.started_at = 0.0
        self.told_at = 0.0
        self.reason: str | None = None

    def perform(self, job: outbox.Job) -> None:
        self.started_at = time.monotonic()
        self.started.set()
        for _ in range(600):
            if job.cancelled.is_set():
                self.told_at = time.monotonic()
                self.reason = getattr(job.cancelled, "reason", None)
                raise RuntimeError("stopped when told")
            time.sleep(0.1)


class TimedStepper(Stepper):
    name = "work.timed"
    timeout = 1.0


def _enqueue(dsn: str, schema: str, effect: str, key: str) -> int:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        job_id = tx.enqueue(effect, key=key, payload={}).job_id
    assert job_id is not None
    return job_id


def _running(dispatcher: outbox.Dispatcher) -> threading.Thread:
    thread = threading.Thread(target=dispatcher.run, daemon=True)
    thread.start()
    return thread


def _status(dsn: str, schema: str, job_id: int) -> tuple[str, str | None]:
    [(status, error)] = fetch(dsn, psycopg.sql.SQL(
        "SELECT status, last_error FROM {} WHERE id = %s").format(table(schema, "jobs")),
        [job_id])
    return status, error


def test_outbox_cancel_tells_a_running_perform_and_the_job_does_not_end_done(
        dsn: str, schema: str) -> None:
    effect = Stepper()
    job_id = _enqueue(dsn, schema, effect.name, "steps-1")
    dispatcher = outbox.Dispatcher(dsn, [effect], schema=schema, lease=30)
    thread = _running(dispatcher)
    try:
        assert effect.started.wait(20)
        asked = time.monotonic()
        result = CliRunner().invoke(main, ["cancel", "--dsn", dsn, "--schema", schema,
                                           str(job_id)])
        assert result.exit_code == 0, result.output
        assert "is running: its perform is told to stop" in result.output
        wait_until(lambda: effect.told_at > 0, 20, "the perform told")
        assert effect.told_at - asked < TOLD_WITHIN and effect.reason == "operator"
        wait_until(lambda: _status(dsn, schema, job_id)[0] != "running", 20, "settled")
        status, error = _status(dsn, schema, job_id)
        assert status == "failed" and "cancelled by an operator while running" in (error or "")
    finally:
        dispatcher.stop()
        thread.join(30)


def test_a_claim_taken_over_tells_its_perform(dsn: str, schema: str) -> None:
    effect = Stepper()
    job_id = _enqueue(dsn, schema, effect.name, "steps-2")
    dispatcher = outbox.Dispatcher(dsn, [effect], schema=schema, lease=2)
    thread = _running(dispatcher)
    try:
        assert effect.started.wait(20)
        with psycopg.connect(dsn, autocommit=True) as conn:  # another claim took it
            conn.execute(psycopg.sql.SQL(
                "UPDATE {} SET claim_version = claim_version + 1 WHERE id = %s").format(
                    table(schema, "jobs")), [job_id])
        moved = time.monotonic()
        wait_until(lambda: effect.told_at > 0, 20, "the perform told")
        assert effect.told_at - moved < TOLD_WITHIN and effect.reason == "lost"
    finally:
        dispatcher.stop()
        thread.join(30)


def test_an_effects_timeout_tells_its_perform(dsn: str, schema: str) -> None:
    effect = TimedStepper()
    job_id = _enqueue(dsn, schema, effect.name, "steps-3")
    dispatcher = outbox.Dispatcher(dsn, [effect], schema=schema, lease=30)
    thread = _running(dispatcher)
    try:
        wait_until(lambda: effect.told_at > 0, 30, "the perform told")
        assert effect.told_at - effect.started_at < TOLD_WITHIN
        assert effect.reason == "timeout"
        # It may have acted: retried with the same key, not failed, not done.
        wait_until(lambda: _status(dsn, schema, job_id)[1] is not None, 20, "settled")
        status, error = _status(dsn, schema, job_id)
        assert status != "done" and "timeout passed" in (error or ""), (status, error)
    finally:
        dispatcher.stop()
        thread.join(30)


RELEASE = threading.Event()  # set at the end: the stuck performs' threads then end


class Stuck(outbox.Effect):
    """Never returns (until the test ends), whatever it is told."""

    name = "work.stuck"

    def __init__(self) -> None:
        self.started = threading.Event()

    def perform(self, job: outbox.Job) -> None:
        self.started.set()
        RELEASE.wait(120)


class StuckAsync(outbox.Effect):
    name = "work.stuck_async"

    def __init__(self) -> None:
        self.started = threading.Event()

    async def perform(self, job: outbox.Job) -> None:
        self.started.set()
        await asyncio.sleep(3600)  # never returns by itself


def test_a_stuck_sync_perform_does_not_hold_the_stop(dsn: str, schema: str) -> None:
    effect = Stuck()
    _enqueue(dsn, schema, effect.name, "stuck-1")
    dispatcher = outbox.Dispatcher(dsn, [effect], schema=schema, stop_timeout=2)
    thread = _running(dispatcher)
    try:
        assert effect.started.wait(20)
        stopped = time.monotonic()
        dispatcher.stop()
        thread.join(30)
        assert not thread.is_alive() and time.monotonic() - stopped < 3.0
    finally:
        RELEASE.set()


def test_a_stuck_async_perform_does_not_hold_the_stop(dsn: str, schema: str) -> None:
    RELEASE.clear()
    effect = StuckAsync()
    _enqueue(dsn, schema, effect.name, "stuck-2")
    took: list[float] = []

    async def main_() -> None:
        dispatcher = outbox.AsyncDispatcher(dsn, [effect], schema=schema, stop_timeout=2)
        task = asyncio.create_task(dispatcher.run())
        assert await asyncio.to_thread(effect.started.wait, 20)
        stopped = time.monotonic()
        dispatcher.stop()
        await asyncio.wait_for(task, 30)
        took.append(time.monotonic() - stopped)

    try:
        asyncio.run(main_())
    finally:
        RELEASE.set()
    assert took[0] < 3.0


def test_cancel_of_a_done_job_says_it_is_done(dsn: str, schema: str) -> None:
    job_id = _enqueue(dsn, schema, "work.steps", "done-1")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(psycopg.sql.SQL("UPDATE {} SET status = 'done' WHERE id = %s").format(
            table(schema, "jobs")), [job_id])
    result = CliRunner().invoke(main, ["cancel", "--dsn", dsn, "--schema", schema,
                                       str(job_id)])
    assert result.exit_code != 0
    assert f"job {job_id} is done" in result.output


@pytest.mark.parametrize("bad", [0, 0.0, -1.0, float("nan"), "soon"])
def test_a_zero_or_negative_timeout_is_refused_at_construction(bad: Any) -> None:
    class Bad(outbox.Effect):
        name = "work.bad"
        timeout = bad

        def perform(self, job: outbox.Job) -> None:
            return None

    with pytest.raises(ConfigurationError, match="effect 'work.bad': timeout must be"):
        outbox.Dispatcher("postgresql:///unused", [Bad()])
