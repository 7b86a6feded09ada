"""``outbox run`` leaves what its process holds once started out of the cyclic
collector's passes (``gc.freeze()``): the command owns its process; the library, used
inside an application's, does not freeze."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time

import psycopg
from psycopg import sql

import outbox


def _result(dsn: str, schema: str, key: str, process: subprocess.Popen[str]) -> object:
    deadline = time.monotonic() + 60
    query = sql.SQL("SELECT result FROM {}.effect_results WHERE key = %s").format(
        sql.Identifier(schema))
    with psycopg.connect(dsn, autocommit=True) as conn:
        while time.monotonic() < deadline:
            assert process.poll() is None, process.communicate()[1]
            row = conn.execute(query, (key,)).fetchone()
            if row is not None:
                return row[0]
            time.sleep(0.05)  # another process's commit: polled, no event to wait on
    raise AssertionError(f"job {key} was never done")


def test_outbox_run_freezes_what_it_holds_before_dispatching(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue("test.frozen", key="frozen-1", payload={})
    env = {**os.environ, "OUTBOX_TEST_TARGET_DSN": dsn, "OUTBOX_TEST_TARGET_SCHEMA": schema}
    process = subprocess.Popen(
        [sys.executable, "-m", "outbox.cli", "run", "tests.operations.frozen_target:dispatcher"],
        env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        result = _result(dsn, schema, "frozen-1", process)
    finally:
        process.send_signal(signal.SIGTERM)
        _out, err = process.communicate(timeout=30)
    assert process.returncode == 0, err
    assert isinstance(result, dict) and result["frozen"] > 1000, result  # modules and all


def test_a_dispatcher_in_an_application_process_freezes_nothing(dsn: str, schema: str) -> None:
    from tests.operations.frozen_target import FrozenCount

    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue("test.frozen", key="frozen-2", payload={})
    before = gc.get_freeze_count()
    outbox.Dispatcher(dsn, [FrozenCount()], schema=schema).run_until_idle(timeout=60)
    assert gc.get_freeze_count() == before == 0
