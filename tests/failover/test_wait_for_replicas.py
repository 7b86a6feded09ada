"""The standby lags when the primary dies: orders acknowledged on the primary are lost
in the failover. With ``wait_for_replicas=True`` none of their effects was performed
(and every order the new primary holds gets its effect); without it, some were: the
phantoms the option exists for.

The lag is made by stopping the primary's WAL sender (SIGSTOP) while orders commit, as a
busy network or a slow standby does; then the primary is killed (-9) and the standby
promoted.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import psycopg
import pytest
from click.testing import CliRunner

from outbox import AsyncDispatcher, ConfigurationError, Dispatcher
from outbox.cli import main

from .support import Orders, Pair, enqueue_orders, pair, prepare, wait_until
from .test_failover import Shop

STALLED_ORDERS = 60  # orders acknowledged after the WAL sender stopped


def _stall_wal_sender(servers: Pair) -> None:
    [(pid,)] = servers.primary.execute("SELECT pid FROM pg_stat_replication")
    psutil.Process(pid).send_signal(signal.SIGSTOP)


def _claimed(servers: Pair, keys: list[str]) -> bool:
    rows = servers.primary.execute(
        "SELECT count(*) FROM outbox.jobs WHERE key = ANY(%s) AND status <> 'pending'",
        (keys,))
    return bool(rows[0][0] == len(keys))


def _held_back(servers: Pair, orders: Orders) -> bool:
    """Whether a job claimed on the primary (running) is not performed."""
    running = servers.primary.execute("SELECT key FROM outbox.jobs WHERE status = 'running'")
    return bool({str(key) for (key,) in running} - orders.seen())


@pytest.mark.parametrize("wait", [True, False], ids=["wait_for_replicas", "without"])
def test_a_lagging_standby_promoted(wait: bool) -> None:
    with pair() as servers:
        prepare(servers.primary)
        orders = Orders()
        dispatcher = Dispatcher(servers.dsn, effects=[orders.effect()], lease=2.0,
                                poll_interval=0.1, wait_for_replicas=wait)
        runner = threading.Thread(target=dispatcher.run)
        shop = Shop(servers.dsn)
        runner.start()
        shop.thread.start()
        try:
            wait_until(lambda: len(orders.seen()) >= 100, 60, "effects before the stall")
            _stall_wal_sender(servers)
            stalled_from = len(shop.acknowledged)
            wait_until(lambda: len(shop.acknowledged) >= stalled_from + STALLED_ORDERS, 30,
                       "orders acknowledged while the standby lags")
            shop.stop.set()
            shop.thread.join(30)
            stalled = shop.acknowledged[stalled_from:]
            if wait:  # a claimed job held back: its commit is not on the standby
                wait_until(lambda: _held_back(servers, orders), 30, "a job held back")
            else:  # each lagging order claimed, and performed, before the primary dies
                wait_until(lambda: _claimed(servers, stalled), 30, "the lagging orders claimed")
            if not wait:
                wait_until(lambda: set(stalled) <= orders.seen(), 30,
                           "the lagging orders performed")
            servers.primary.kill9()
            servers.standby.promote()

            def settled() -> bool:
                return not servers.standby.execute(
                    "SELECT 1 FROM outbox.jobs WHERE status <> 'done' LIMIT 1")

            wait_until(settled, 60, "every job on the new primary done")
        finally:
            shop.stop.set()
            dispatcher.stop()
            runner.join(30)
        assert not runner.is_alive()
        kept = {str(k) for (k,) in servers.standby.execute("SELECT key FROM orders")}
        lost = set(shop.acknowledged) - kept
        phantoms = lost & orders.seen()
        assert lost, "the failover lost no order: the standby did not lag"
        assert kept <= orders.seen()  # every order the new primary holds: performed
        if wait:
            assert phantoms == set(), sorted(phantoms)
        else:
            # Each lost order was performed before the failover: a phantom effect.
            assert phantoms == lost, (len(phantoms), len(lost))


def test_the_role_must_read_the_standbys_positions(tmp_path: Path) -> None:
    with pair() as servers:
        prepare(servers.primary)
        servers.primary.execute(
            "CREATE ROLE worker LOGIN; GRANT ALL ON SCHEMA outbox TO worker;"
            " GRANT ALL ON ALL TABLES IN SCHEMA outbox TO worker;"
            " GRANT ALL ON ALL SEQUENCES IN SCHEMA outbox TO worker")
        dsn = servers.dsn.replace("user=postgres", "user=worker")
        with pytest.raises(ConfigurationError, match="GRANT pg_monitor TO worker"):
            Dispatcher(dsn, effects=[Orders().effect()],
                       wait_for_replicas=True).run_until_idle(timeout=30)
        with pytest.raises(ConfigurationError, match="GRANT pg_monitor TO worker"):
            asyncio.run(AsyncDispatcher(dsn, effects=[Orders().effect()],
                                        wait_for_replicas=True).run_until_idle(timeout=30))
        # outbox run --wait-for-replicas turns it on for a dispatcher built without it.
        module = tmp_path / "shop_worker.py"
        module.write_text(
            "import os\nimport outbox\n\n\nclass Charge(outbox.Effect):\n"
            "    name = 'order.charge'\n\n    def perform(self, job):\n        pass\n\n\n"
            "dispatcher = outbox.Dispatcher(os.environ['OUTBOX_DATABASE_URL'], "
            "[Charge()])\n")
        env = {**os.environ, "PYTHONPATH": str(tmp_path), "OUTBOX_DATABASE_URL": dsn}
        done = subprocess.run(
            [sys.executable, "-m", "outbox.cli", "run", "shop_worker:dispatcher",
             "--wait-for-replicas"], cwd=tmp_path, env=env, capture_output=True, text=True,
            timeout=60, check=False)
        assert done.returncode == 1, done.stderr
        assert "GRANT pg_monitor TO worker" in done.stderr, done.stderr
        # --wait-for-standby NAME turns it on for the standbys named.
        named = subprocess.run(
            [sys.executable, "-m", "outbox.cli", "run", "shop_worker:dispatcher",
             "--wait-for-standby", "standby,other"], cwd=tmp_path, env=env,
            capture_output=True, text=True, timeout=60, check=False)
        assert named.returncode == 1, named.stderr
        assert "GRANT pg_monitor TO worker" in named.stderr, named.stderr
        servers.primary.execute("GRANT pg_monitor TO worker")
        with psycopg.connect(servers.primary.dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO orders VALUES ('k-1')")
        enqueue_orders(servers.primary.dsn, ["k-2"])
        orders = Orders()
        stats = Dispatcher(dsn, effects=[orders.effect()],
                           wait_for_replicas=True).run_until_idle(timeout=30)
        assert stats.done == 1 and orders.seen() == {"k-2"}


def test_async_dispatcher_waits_for_the_standby(caplog: pytest.LogCaptureFixture) -> None:
    with pair() as servers:
        prepare(servers.primary)
        enqueue_orders(servers.dsn, [f"a-{n}" for n in range(20)])
        orders = Orders()
        dispatcher = AsyncDispatcher(servers.dsn, effects=[orders.effect()],
                                     wait_for_replicas=True)
        assert asyncio.run(dispatcher.run_until_idle(timeout=60)).done == 20
        # The standby stopped: the claimed jobs wait, none is performed; a stop hands
        # them back.
        _stall_wal_sender(servers)
        enqueue_orders(servers.dsn, [f"b-{n}" for n in range(5)])

        async def run_then_stop() -> None:
            task = asyncio.create_task(dispatcher.run())
            await asyncio.to_thread(wait_until, lambda: _claimed(
                servers, [f"b-{n}" for n in range(5)]), 30, "the jobs claimed")
            dispatcher.stop()
            await task

        with caplog.at_level(logging.WARNING, logger="outbox"):
            asyncio.run(run_then_stop())
        assert orders.seen() == {f"a-{n}" for n in range(20)}
        rows = servers.primary.execute(
            "SELECT status, count(*) FROM outbox.jobs WHERE key LIKE 'b-%' GROUP BY 1")
        assert rows == [("pending", 5)]


def _stall(servers: Pair, name: str) -> None:
    """Stop the WAL sender feeding the standby ``name``: it flushes nothing more."""
    [(pid,)] = servers.primary.execute(
        "SELECT pid FROM pg_stat_replication WHERE application_name = %s", (name,))
    psutil.Process(pid).send_signal(signal.SIGSTOP)


def test_only_the_named_standbys_are_waited_for() -> None:
    """Two standbys: ``standby`` (named) and ``other``. With ``other`` stalled, jobs
    waiting for ``["standby"]`` are performed; with ``standby`` stalled, they wait."""
    with pair() as servers:
        servers.add_standby("other")
        prepare(servers.primary)
        _stall(servers, "other")
        enqueue_orders(servers.primary.dsn, [f"a-{n}" for n in range(5)])
        orders = Orders()
        stats = Dispatcher(servers.dsn, effects=[orders.effect()],
                           wait_for_replicas=["standby"]).run_until_idle(timeout=30)
        assert stats.done == 5 and orders.seen() == {f"a-{n}" for n in range(5)}
        # The named one stalled too: claimed jobs are held, none performed.
        _stall(servers, "standby")
        held = [f"b-{n}" for n in range(3)]
        enqueue_orders(servers.primary.dsn, held)
        dispatcher = Dispatcher(servers.dsn, effects=[orders.effect()], poll_interval=0.1,
                                wait_for_replicas=["standby"])
        runner = threading.Thread(target=dispatcher.run)
        runner.start()
        try:
            wait_until(lambda: _claimed(servers, held), 30, "the jobs claimed")
            wait_until(lambda: _held_back(servers, orders), 30, "the jobs held back")
        finally:
            dispatcher.stop()
            runner.join(30)
        assert not runner.is_alive()
        assert not set(held) & orders.seen()
        rows = servers.primary.execute(
            "SELECT status, count(*) FROM outbox.jobs WHERE key LIKE 'b-%' GROUP BY 1")
        assert rows == [("pending", 3)]


@pytest.mark.parametrize(("given", "says"), [
    ([], "names no standby"),
    ("standby1", "must be True, False or a list of standby names"),
    (["standby1", 2], r"wait_for_replicas\[1\] must be a standby's name"),
    (["standby1", " "], r"wait_for_replicas\[1\] must be a standby's name"),
    (["a", "a"], "names a standby twice"),
    (1, "must be True, False or a list"),
])
def test_wait_for_replicas_is_checked_at_construction(given: object, says: str) -> None:
    with pytest.raises(ConfigurationError, match=says):
        Dispatcher("postgresql://nowhere/none", effects=[Orders().effect()],
                   wait_for_replicas=given)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=says):
        AsyncDispatcher("postgresql://nowhere/none", effects=[Orders().effect()],
                        wait_for_replicas=given)  # type: ignore[arg-type]


@pytest.mark.parametrize(("arguments", "says"), [
    (["--wait-for-standby", "a,,b"], "wait_for_replicas[1] must be a standby's name"),
    (["--wait-for-standby", "a", "--wait-for-standby", "a"], "names a standby twice"),
    (["--wait-for-standby", "a", "--wait-for-replicas"], "not both"),
])
def test_the_command_line_checks_the_standbys_named(arguments: list[str], says: str) -> None:
    result = CliRunner().invoke(main, ["run", "nowhere:dispatcher", *arguments])
    assert result.exit_code == 2, result.output
    assert says in " ".join(result.output.split()), result.output
