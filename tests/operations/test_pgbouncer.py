"""Dispatching through PgBouncer in transaction-pooling mode.

The pool has fewer server connections than there are clients, so dispatcher
connections share server sessions with each other and with other clients: nothing may
rely on session state (SET, prepared statements, LISTEN) on the pooled connections.
Skipped, saying how to install it, where the ``pgbouncer`` binary is missing.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

import outbox
from outbox import NewJob
from outbox.testing import jobs, ledger

from . import pgbouncer
from .pgbouncer import INSTALL_HINT, PgBouncer

pytestmark = pytest.mark.skipif(pgbouncer.binary() is None, reason=INSTALL_HINT)

SETTINGS = ("statement_timeout", "idle_in_transaction_session_timeout",
            "default_transaction_isolation", "client_connection_check_interval")


@pytest.fixture
def bouncer(dsn: str) -> Iterator[PgBouncer]:
    running = pgbouncer.start(dsn)
    yield running
    running.stop()


class Recording(outbox.Effect):
    """Counts performances per key (thread-safe)."""

    name = "pooled.noop"

    def __init__(self) -> None:
        self.performed: dict[str, int] = {}
        self._lock = threading.Lock()

    def perform(self, job: outbox.Job) -> dict[str, Any]:
        with self._lock:
            self.performed[job.key] = self.performed.get(job.key, 0) + 1
        return {"ok": job.key}


def _enqueue(conninfo: str, schema: str, keys: list[str], effect: str = Recording.name) -> None:
    # The application's own connection through the pooler: no prepared statements.
    with psycopg.connect(conninfo, prepare_threshold=None) as conn, \
            outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue_many(NewJob(effect, key, {"n": i}) for i, key in enumerate(keys))


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_enqueue_and_drain_through_pgbouncer(bouncer: PgBouncer, schema: str, flavour: str) -> None:
    keys = [f"k{i}" for i in range(300)]
    _enqueue(bouncer.dsn, schema, keys)
    effect = Recording()
    if flavour == "sync":
        stats = outbox.Dispatcher(bouncer.dsn, [effect], schema=schema, concurrency=8,
                                  listen_conninfo=bouncer.direct).run_until_idle(timeout=120)
    else:
        stats = asyncio.run(outbox.AsyncDispatcher(
            bouncer.dsn, [effect], schema=schema, concurrency=8, listen_conninfo=bouncer.direct,
        ).run_until_idle(timeout=120))
    assert stats.done == len(keys)
    assert effect.performed == dict.fromkeys(keys, 1)
    assert {j["status"] for j in jobs(bouncer.direct, schema).values()} == {"done"}
    assert sorted(ledger(bouncer.direct, schema)) == sorted(keys)


# With a direct listen connection, the poll interval is an hour: only a notification can
# wake the dispatcher in time. Without one, the dispatcher must poll.
@pytest.mark.parametrize(("listen", "poll_interval"), [(True, 3600.0), (False, 0.5)],
                         ids=["woken-by-listen-direct", "poll-only"])
def test_run_picks_up_new_jobs_through_pgbouncer(
    bouncer: PgBouncer, schema: str, listen: bool, poll_interval: float,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="outbox.dispatcher")
    effect = Recording()
    dispatcher = outbox.Dispatcher(bouncer.dsn, [effect], schema=schema, concurrency=4,
                                   poll_interval=poll_interval,
                                   listen_conninfo=bouncer.direct if listen else None)
    thread = threading.Thread(target=dispatcher.run)
    thread.start()
    try:
        for wave in range(3):
            keys = [f"w{wave}-{i}" for i in range(20)]
            _enqueue(bouncer.dsn, schema, keys)
            _wait_done(bouncer.direct, schema, keys)
    finally:
        dispatcher.stop()
        thread.join(timeout=60)
    assert not thread.is_alive()
    assert set(effect.performed.values()) == {1} and len(effect.performed) == 60
    # Polling alone would pass the waves above: the dispatcher must also have known not
    # to LISTEN through the pooler (where a notification reaches a session nobody reads),
    # and to LISTEN on the direct connection it was given.
    polled = [r for r in caplog.records
              if "goes through a pooler, where LISTEN cannot work: polling" in r.getMessage()]
    assert bool(polled) == (not listen), [r.getMessage() for r in caplog.records]


def _wait_done(direct: str, schema: str, keys: list[str], timeout: float = 60) -> None:
    from tests.integration.helpers import wait_until

    def done() -> bool:
        found = jobs(direct, schema)
        return all(found.get(k, {}).get("status") == "done" for k in keys)

    wait_until(done, timeout, f"{len(keys)} jobs done")


def _server_defaults(direct: str) -> dict[str, str]:
    with psycopg.connect(direct, autocommit=True) as conn:
        return {name: str(conn.execute("SELECT current_setting(%s)", (name,)).fetchone()[0])  # type: ignore[index]
                for name in SETTINGS}


def _pooled_sessions_settings(bouncer: PgBouncer) -> list[dict[str, str]]:
    """The settings of every server session in the pool: as many clients as the pool has
    server connections each hold a transaction open, so each sits on its own session."""
    clients = [psycopg.connect(bouncer.dsn, prepare_threshold=None)
               for _ in range(pgbouncer.POOL_SIZE)]
    try:
        seen = []
        for client in clients:
            pid = client.execute("SELECT pg_backend_pid()").fetchone()
            seen.append({"pid": str(pid)} | {
                name: str(client.execute("SELECT current_setting(%s)", (name,)).fetchone()[0])  # type: ignore[index]
                for name in SETTINGS})
        assert len({s["pid"] for s in seen}) == pgbouncer.POOL_SIZE
        return [{k: v for k, v in s.items() if k != "pid"} for s in seen]
    finally:
        for client in clients:
            client.rollback()
            client.close()


def test_no_setting_leaks_to_other_clients_of_the_pool(bouncer: PgBouncer, schema: str) -> None:
    keys = [f"k{i}" for i in range(100)]
    _enqueue(bouncer.dsn, schema, keys)
    dispatcher = outbox.Dispatcher(bouncer.dsn, [Recording()], schema=schema, concurrency=8,
                                   listen_conninfo=bouncer.direct)
    assert dispatcher.run_until_idle(timeout=120).done == len(keys)
    defaults = _server_defaults(bouncer.direct)
    assert _pooled_sessions_settings(bouncer) == [defaults] * pgbouncer.POOL_SIZE


APP = """
    import threading
    import outbox

    class Slow(outbox.Effect):
        name = "pooled.noop"

        def perform(self, job):
            threading.Event().wait(600)  # until the process is killed

    dispatcher = outbox.Dispatcher({pooled!r}, [Slow()], schema={schema!r}, concurrency=4,
                                   lease=1.0, listen_conninfo={direct!r})
"""


def test_a_worker_killed_mid_run_is_rescued_through_pgbouncer(
    bouncer: PgBouncer, schema: str, tmp_path: Path
) -> None:
    from tests.integration.helpers import wait_until

    keys = [f"k{i}" for i in range(12)]
    _enqueue(bouncer.dsn, schema, keys)
    (tmp_path / "pooled_app.py").write_text(textwrap.dedent(APP.format(
        pooled=bouncer.dsn, direct=bouncer.direct, schema=schema)))
    worker = subprocess.Popen([sys.executable, "-m", "outbox.cli", "run", "pooled_app:dispatcher"],
                              cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        def holding() -> bool:
            return any(j["status"] == "running" for j in jobs(bouncer.direct, schema).values())
        wait_until(holding, 60, "the worker to hold jobs")
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=30)
        assert worker.stderr is not None
        worker.stderr.close()
    held = {k for k, j in jobs(bouncer.direct, schema).items() if j["status"] == "running"}
    assert held
    effect = Recording()
    stats = outbox.Dispatcher(bouncer.dsn, [effect], schema=schema, lease=1.0,
                              rescue_interval=0.1, listen_conninfo=bouncer.direct,
                              ).run_until_idle(timeout=120)
    assert stats.done == len(keys)
    after = jobs(bouncer.direct, schema)
    assert {j["status"] for j in after.values()} == {"done"}
    assert held <= {k for k, j in after.items() if j["attempts"] == 2}  # rescued, run again
    assert effect.performed == dict.fromkeys(keys, 1)


def test_a_pooled_role_that_defaults_to_serializable_is_a_configuration_error(
    bouncer: PgBouncer, dsn: str
) -> None:
    import uuid

    from psycopg import sql
    from psycopg.conninfo import make_conninfo

    name = f"ser_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        conn.execute(sql.SQL("ALTER DATABASE {} SET default_transaction_isolation = "
                             "'serializable'").format(sql.Identifier(name)))
    try:
        with psycopg.connect(make_conninfo(dsn, dbname=name), autocommit=True) as conn:
            outbox.migrate(conn)
        pooled = make_conninfo(bouncer.dsn, dbname=name)
        with pytest.raises(outbox.ConfigurationError, match="'serializable'.*read committed"):
            outbox.Dispatcher(pooled, [Recording()]).run_until_idle()
        # A direct connection SETs its own session: the same database works there.
        direct = make_conninfo(dsn, dbname=name)
        assert outbox.Dispatcher(direct, [Recording()]).run_until_idle().done == 0
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_hooks_pipelined_through_pgbouncer_write_once_and_a_raise_costs_its_own_job(
    bouncer: PgBouncer, schema: str, flavour: str,
) -> None:
    """The hooks of a chunk send their statements in one pipeline, with savepoints when
    one raises: through the pooler too, each hook's row is written once, the raising
    job is retried (its row never kept), and no other client sees the transaction;
    ``AsyncDispatcher``'s ``async def`` hooks alike."""
    keys = [f"k{i}" for i in range(300)]
    with psycopg.connect(bouncer.direct, autocommit=True) as conn:
        conn.execute(f'CREATE TABLE "{schema}".paid (key text PRIMARY KEY)')
    _enqueue(bouncer.dsn, schema, keys)
    effect = Recording()
    raised: list[str] = []

    def record(tx: outbox.HookTransaction, job: outbox.Job, result: Any) -> None:
        tx.execute(f'INSERT INTO "{schema}".paid VALUES (%s)', (job.key,))
        if job.key == "k150" and job.attempt == 1:
            raised.append(job.key)
            raise RuntimeError("the order is locked")

    async def record_async(tx: outbox.AsyncHookTransaction, job: outbox.Job,
                           result: Any) -> None:
        await tx.execute(f'INSERT INTO "{schema}".paid VALUES (%s)', (job.key,))
        if job.key == "k150" and job.attempt == 1:
            raised.append(job.key)
            raise RuntimeError("the order is locked")

    def drain(**options: Any) -> outbox.DispatchStats:
        if flavour == "sync":
            return outbox.Dispatcher(
                bouncer.dsn, [effect], schema=schema, concurrency=8,
                listen_conninfo=bouncer.direct, on_done={Recording.name: record},
                **options).run_until_idle(timeout=120)
        return asyncio.run(outbox.AsyncDispatcher(
            bouncer.dsn, [effect], schema=schema, concurrency=8,
            listen_conninfo=bouncer.direct, on_done={Recording.name: record_async},
            **options).run_until_idle(timeout=120))

    stats = drain(backoff=outbox.Backoff(base=0.001, cap=0.005))
    if stats.done < len(keys):  # the retry was not due yet when the first run went idle
        stats = drain()
    assert raised == ["k150"]
    with psycopg.connect(bouncer.direct, autocommit=True) as conn:
        paid = [k for k, in conn.execute(f'SELECT key FROM "{schema}".paid ORDER BY key')]
    assert paid == sorted(keys)
    assert effect.performed == dict.fromkeys(keys, 1)  # the kept answer: not performed again
    assert {j["status"] for j in jobs(bouncer.direct, schema).values()} == {"done"}
