"""A limit shared across targets (``Limit(shared=True)`` with a ``limits_home``) against
real PostgreSQL and real processes: one provider account's rate held across tenant
databases and dispatcher processes, a throttle in one target pausing them all, and a home
that cannot be reached holding back only the shared effect."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest
from click.testing import CliRunner
from psycopg import sql

import outbox
from outbox import Dispatcher, Limit, NewJob, Target, Throttled
from outbox.cli import main as cli
from outbox.cli import start_line
from outbox.errors import ConfigurationError
from outbox.limits import parse_limit

from ..limits.support import assert_within_rate
from .shared_worker import QUICK_EFFECT, Quick
from .support import Databases, statuses

REPO = Path(__file__).resolve().parents[2]
# A claim stamps its job (first_attempted_at) in its target a moment after the home
# granted its token, in another statement on another connection: this is that moment's
# allowance on a loaded machine, far below what an unshared budget would run ahead by
# (each target its own 10/s: the 30th claim a second and a half early).
GRANT_TO_CLAIM = timedelta(milliseconds=250)


def enqueue(target: Target, count: int, effect: str = QUICK_EFFECT) -> None:
    with psycopg.connect(target.dsn) as conn, outbox.transaction(conn, schema=target.schema) as tx:
        tx.enqueue_many([NewJob(effect, f"{target.name}/{effect}/{i}", {})
                         for i in range(count)])


def claims(target: Target) -> list[datetime]:
    with psycopg.connect(target.dsn, autocommit=True) as conn:
        return [row[0] for row in conn.execute(sql.SQL(
            "SELECT first_attempted_at FROM {}.jobs WHERE first_attempted_at IS NOT NULL "
            "ORDER BY 1").format(sql.Identifier(target.schema)))]


def make_home(databases: Databases) -> Target:
    home = Target(databases.make("limits_home"), "limits_home")
    with psycopg.connect(home.dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE limits_home.limit_ready (pid integer)")  # the workers' barrier
    return home


def test_one_rate_holds_across_targets_and_processes(databases: Databases) -> None:
    first, second, third = (Target(databases.make("outbox")) for _ in range(3))
    home = make_home(databases)
    for target in (first, second, third):
        enqueue(target, 20)
    # A fleet over two tenant databases and a plain dispatcher on a third, in two
    # processes: alone, each target's claims could run at 10/s; shared, all at 10/s.
    def worker(*targets: Target) -> subprocess.Popen[str]:
        command = [sys.executable, "-m", "tests.targets.shared_worker", "--home",
                   f"{home.dsn}#{home.schema}", "--limit", "10/s,burst=2,shared",
                   "--together", "2"]
        for target in targets:
            command += ["--target", f"{target.dsn}#{target.schema}"]
        return subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONWARNINGS": "error"})

    workers = [worker(first, second), worker(third)]
    try:
        for process in workers:
            _, err = process.communicate(timeout=120)
            assert process.returncode == 0, err[-2000:]
    finally:
        for process in workers:
            if process.poll() is None:
                process.kill()
                process.wait()
    for target in (first, second, third):
        assert statuses(target) == Counter(done=20), target
    assert_within_rate(sorted(claims(first) + claims(second) + claims(third)),
                       rate=10.0, burst=2.0, slack=GRANT_TO_CLAIM)
    fleet, alone = sorted(claims(first) + claims(second)), claims(third)
    assert fleet[0] < alone[-1] and alone[0] < fleet[-1], "the two processes never overlapped"
    with psycopg.connect(home.dsn, autocommit=True) as conn:
        row = conn.execute("SELECT granted_total, rate, burst FROM limits_home.shared_limits "
                           "WHERE effect = %s", (QUICK_EFFECT,)).fetchone()
    assert row == (60, 10.0, 2.0)  # every token granted was used or given back


def test_a_throttle_in_one_target_pauses_every_target(databases: Databases) -> None:
    shared_db = databases.make("tenant_a", "tenant_b")
    home = make_home(databases)
    tenant_a, tenant_b = Target(shared_db, "tenant_a"), Target(shared_db, "tenant_b")
    enqueue(tenant_a, 1)
    enqueue(tenant_b, 15)
    throttled_at: list[datetime] = []

    class PushesBackOnce(Quick):
        """Tenant a's job meets the provider's 429 (retry after 1.5 s) once."""

        def perform(self, job: outbox.Job) -> None:
            if job.key.startswith(tenant_a.name) and not throttled_at:
                throttled_at.append(datetime.now(UTC))
                raise Throttled(1.5, "429 from the provider")

    Dispatcher(effects=[PushesBackOnce()], targets=[tenant_a, tenant_b],
               limits={QUICK_EFFECT: Limit(rate=5.0, burst=1, shared=True)},
               limits_home=home, poll_interval=0.1).run_until_idle(timeout=60)
    # Tenant a's job waits out its Retry-After, its attempt refunded: done if tenant b's
    # work lasted past it (run_until_idle does not wait for a delayed job).
    assert statuses(tenant_a) in (Counter(pending=1), Counter(done=1))
    assert statuses(tenant_b) == Counter(done=15)
    assert throttled_at, "the provider never pushed back"
    throttle = throttled_at[0]
    after = [at for at in claims(tenant_b) if at > throttle]
    assert after, "tenant b was done before the throttle: nothing shows the pause"
    # Tenant b's engine saw no throttle itself: only the home's pause holds it back. A
    # token granted just before the pause reached the home may still be claimed with;
    # after that, nothing until the provider's 1.5 s are over (at 5/s, without the
    # pause, about six claims would fall in that time).
    held_back = [at - throttle for at in after
                 if throttle + GRANT_TO_CLAIM < at < throttle + timedelta(seconds=1.5)
                 - GRANT_TO_CLAIM]
    assert not held_back, held_back
    # outbox status on the home shows the shared bucket and the throttle it took.
    result = CliRunner().invoke(cli, ["status", "--dsn", home.dsn, "--schema", home.schema,
                                      "--json"])
    assert result.exit_code == 0, result.output
    [bucket] = json.loads(result.output)["shared_limits"]
    assert (bucket["effect"], bucket["rate"], bucket["burst"]) == (QUICK_EFFECT, 5.0, 1.0)
    assert bucket["throttles"] >= 1 and bucket["granted_total"] >= 16
    text = CliRunner().invoke(cli, ["status", "--dsn", home.dsn, "--schema", home.schema])
    assert f"{QUICK_EFFECT}" in text.output and "limits shared across targets" in text.output


def test_a_home_out_of_reach_holds_back_only_the_shared_effect(
        databases: Databases, dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    tenant = Target(databases.make("outbox"))
    home = make_home(databases)
    enqueue(tenant, 5)
    enqueue(tenant, 5, effect="other.effect")
    with psycopg.connect(dsn, autocommit=True) as admin:
        home_db = psycopg.conninfo.conninfo_to_dict(home.dsn)["dbname"]
        admin.execute(sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS false").format(
            sql.Identifier(str(home_db))))
    other = Quick()
    other.name = "other.effect"  # type: ignore[misc]
    dispatcher = Dispatcher(effects=[Quick(), other], targets=[tenant],
                            limits={QUICK_EFFECT: Limit(rate=50.0, shared=True)},
                            limits_home=home, poll_interval=0.1)
    with caplog.at_level(logging.WARNING, logger="outbox.dispatcher"):
        stats = dispatcher.run_until_idle(timeout=4)
    assert stats.done == 5 and statuses(tenant) == Counter(done=5, pending=5)
    down = [r.getMessage() for r in caplog.records if "limits home" in r.getMessage()]
    assert len(down) == 1 and "grant nothing" in down[0], down
    assert "password" not in down[0]
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS true").format(
            sql.Identifier(str(home_db))))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="outbox.dispatcher"):
        assert dispatcher.run_until_idle(timeout=60).done == 5
    assert statuses(tenant) == Counter(done=10)


class SilentServer:
    """Accepts connections and never answers (a host behind a firewall that drops
    packets looks the same to a client waiting for connect_timeout)."""

    def __init__(self) -> None:
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.socket.listen(16)
        self.port = self.socket.getsockname()[1]
        self.clients: list[socket.socket] = []
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self) -> None:
        while True:
            try:
                client, _ = self.socket.accept()
            except OSError:
                return
            self.clients.append(client)  # held open, never answered

    def close(self) -> None:
        self.socket.close()
        for client in self.clients:
            client.close()


def test_a_home_that_never_answers_holds_back_no_other_effect(
        databases: Databases, caplog: pytest.LogCaptureFixture) -> None:
    silent = SilentServer()
    tenant = Target(databases.make("outbox"))
    enqueue(tenant, 5)
    enqueue(tenant, 20, effect="other.effect")
    performed: list[float] = []

    class Other(Quick):
        name = "other.effect"

        def perform(self, job: outbox.Job) -> None:
            performed.append(time.time())

    home = Target(f"host=127.0.0.1 port={silent.port} dbname=home user=nobody", "outbox")
    dispatcher = Dispatcher(effects=[Quick(), Other()], targets=[tenant],
                            limits={QUICK_EFFECT: Limit(rate=50.0, shared=True)},
                            limits_home=home, poll_interval=0.1)
    try:
        with caplog.at_level(logging.WARNING, logger="outbox.dispatcher"):
            # Past the home's connect_timeout (5 s): the first try gives up meanwhile.
            stats = dispatcher.run_until_idle(timeout=8)
    finally:
        silent.close()
    assert stats.done == 20 and statuses(tenant) == Counter(done=20, pending=5)
    [gave_up] = [r for r in caplog.records if "limits home" in r.getMessage()]
    assert "timeout" in gave_up.getMessage(), gave_up.getMessage()
    # Every job of the other effect was done before the first try to reach the home gave
    # up: no claim waited for it.
    assert max(performed) < gave_up.created


def test_the_async_dispatcher_takes_its_tokens_from_the_home(databases: Databases) -> None:
    import asyncio

    tenant = Target(databases.make("outbox"))
    home = make_home(databases)
    enqueue(tenant, 12)
    asyncio.run(outbox.AsyncDispatcher(
        effects=[Quick()], targets=[tenant], poll_interval=0.1, limits_home=home,
        limits={QUICK_EFFECT: Limit(rate=10.0, burst=2, shared=True)}).run_until_idle(
            timeout=60))
    assert statuses(tenant) == Counter(done=12)
    assert_within_rate(claims(tenant), rate=10.0, burst=2.0, slack=GRANT_TO_CLAIM)
    with psycopg.connect(home.dsn, autocommit=True) as conn:
        row = conn.execute("SELECT granted_total FROM limits_home.shared_limits").fetchone()
    assert row == (12,)


def test_a_shared_limit_needs_a_home_and_a_rate() -> None:
    with pytest.raises(ConfigurationError, match="limits_home"):
        Dispatcher("dbname=x", [Quick()], limits={QUICK_EFFECT: Limit(rate=1, shared=True)})
    with pytest.raises(ValueError, match="needs a rate"):
        Limit(concurrency=2, shared=True)
    with pytest.raises(ValueError, match="cannot be combined"):
        Limit(rate=2, per_group=True, shared=True)
    assert parse_limit("100/s,burst=5,shared") == Limit(rate=100, burst=5, shared=True)
    assert str(Limit(rate=100, shared=True)) == "100/s,shared"
    dispatcher = Dispatcher("dbname=x", [Quick()], limits_home="dbname=y")
    with pytest.raises(ConfigurationError, match="limits_home"):
        Dispatcher("dbname=x", [Quick()]).add_limits({QUICK_EFFECT: Limit(rate=1, shared=True)})
    dispatcher.add_limits({QUICK_EFFECT: Limit(rate=1, shared=True)})
    assert dispatcher.settings.limits_home == Target("dbname=y")


def test_outbox_run_takes_a_limits_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        dsn: str) -> None:
    # A database that does not exist: the run stops at its preflight, past the limits.
    nowhere = psycopg.conninfo.make_conninfo(dsn, dbname="no_such_database")
    module = tmp_path / "shared_app.py"
    module.write_text("import outbox\n"
                      "from tests.targets.shared_worker import Quick\n"
                      f"dispatcher = outbox.Dispatcher({nowhere!r}, [Quick()])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    limit = ["--limit", f"{QUICK_EFFECT}=5/s,shared"]
    result = CliRunner().invoke(cli, ["run", "shared_app:dispatcher", *limit])
    assert result.exit_code != 0 and "limits_home" in result.output, result.output
    result = CliRunner().invoke(cli, ["run", "shared_app:dispatcher", *limit,
                                      "--limits-home", f"{dsn}#limits_home"])
    assert result.exit_code != 0, result.output
    assert "limits_home" not in result.output and "no_such_database" in result.output, (
        result.output)


def test_the_start_line_names_the_home_and_never_its_password() -> None:
    home = Target("postgresql://app:s3cret-pw@db-limits:5433/control", "limits")
    dispatcher = Dispatcher("postgresql://app:s3cret-pw@db/app", [Quick()], limits_home=home,
                            limits={QUICK_EFFECT: Limit(rate=5, shared=True)})
    line = start_line(dispatcher)
    assert f"the limits of {QUICK_EFFECT} counted in {home.name}" in line, line
    assert "s3cret" not in line and "s3cret" not in home.name


class Held(outbox.Effect):
    """The first job holds its worker until told; the others wait claimed behind it."""

    name = "shared.held"

    def __init__(self) -> None:
        self.started = threading.Event()
        self.go = threading.Event()

    def perform(self, job: outbox.Job) -> None:
        self.started.set()
        assert self.go.wait(60), "never told to finish"


def test_the_tokens_of_claims_handed_back_unperformed_go_back_to_the_home(
        databases: Databases) -> None:
    """A stop hands back the jobs claimed and not started (a fleet's turn ends the same
    way): each spent a token of the shared bucket, which goes back to the home, so the
    jobs performed, not the claims, are what the shared rate counts."""
    target = Target(databases.make("outbox"))
    home = make_home(databases)
    with psycopg.connect(target.dsn) as conn, \
            outbox.transaction(conn, schema=target.schema) as tx:
        tx.enqueue_many([NewJob(Held.name, f"held/{i}", {}) for i in range(5)])
    effect = Held()
    dispatcher = Dispatcher(target.dsn, [effect], schema=target.schema, concurrency=1,
                            prefetch=4, limits={Held.name: parse_limit("100/s,burst=5,shared")},
                            limits_home=home, poll_interval=0.1)
    run = threading.Thread(target=dispatcher.run)
    run.start()
    try:
        assert effect.started.wait(60)
        dispatcher.stop()  # the 4 others, claimed behind the first, are handed back
    finally:
        effect.go.set()
        run.join(60)
    assert not run.is_alive()
    assert statuses(target) == Counter(done=1, pending=4)
    with psycopg.connect(home.dsn, autocommit=True) as conn:
        [(granted,)] = conn.execute(
            "SELECT granted_total FROM limits_home.shared_limits WHERE effect = %s",
            (Held.name,)).fetchall()
    assert granted == 1  # 5 granted for the claim; the 4 handed back were given back
