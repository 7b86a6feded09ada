"""Chaos with SIGSTOP longer than the lease: the paused performs, once woken, are told
before their next step, so none goes on acting after its claim was taken over."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psycopg
from psycopg import sql

import outbox

from ..crash.support import process_stopped, wait_until
from .stepping_worker import EFFECT, ActingStepper

REPO = Path(__file__).resolve().parents[2]
JOBS = 4
STEPS = 40  # 4 s of steps a perform: longer than the 1 s lease and the 2.5 s pause


def _acts(dsn: str, schema: str, query: str,
          params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(sql.SQL(query).format(sql.Identifier(schema)), params).fetchall()


def test_a_perform_paused_past_its_lease_is_told_before_its_next_step(
        dsn: str, schema: str, tmp_path: Path) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL(
            "CREATE TABLE {}.acts (key text, claim_version bigint, step int, pid int,"
            " at timestamptz DEFAULT clock_timestamp())").format(sql.Identifier(schema)))
        with outbox.transaction(conn, schema=schema) as tx:
            for n in range(JOBS):
                tx.enqueue(EFFECT, key=f"step-{n}", payload={})
    env = {**os.environ, "OUTBOX_DATABASE_URL": dsn}
    with (tmp_path / "worker.log").open("wb") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "tests.cancel.stepping_worker", schema, str(STEPS)],
            cwd=REPO, env=env, stdout=log, stderr=log)
    try:
        wait_until(lambda: len(_acts(dsn, schema, "SELECT DISTINCT key FROM {}.acts"))
                   == JOBS, "every job's first step")
        worker.send_signal(signal.SIGSTOP)
        wait_until(lambda: process_stopped(worker.pid), "the worker to stop")
        stopped_at = time.monotonic()
        # Another dispatcher takes the expired claims over and performs them (version 2).
        rescuer = outbox.Dispatcher(dsn, [ActingStepper(dsn, schema, 3)], schema=schema,
                                    lease=1.0, rescue_interval=0.2, concurrency=8)
        stats = rescuer.run_until_idle(timeout=60)
        assert stats.done == JOBS
        time.sleep(max(0.0, 2.5 - (time.monotonic() - stopped_at)))  # the pause's length
        [(woken_at,)] = _acts(dsn, schema, "SELECT clock_timestamp() FROM {}.acts LIMIT 1")
        worker.send_signal(signal.SIGCONT)
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    acted_after = _acts(dsn, schema, (
        "SELECT key, count(*) FROM {}.acts WHERE claim_version = 1 AND pid = %s"
        " AND at > %s GROUP BY key"), (worker.pid, woken_at))
    late = {str(key): int(str(count)) for key, count in acted_after}
    # A step already past its check when the signal landed may still write once; no
    # perform takes another step once woken (without job.cancelled: every one would go on
    # for the rest of its 40 steps).
    assert all(count <= 1 for count in late.values()), late
    with psycopg.connect(dsn) as conn:
        done = conn.execute(sql.SQL("SELECT count(*) FROM {}.effect_results").format(
            sql.Identifier(schema))).fetchone()
    assert done == (JOBS,)
