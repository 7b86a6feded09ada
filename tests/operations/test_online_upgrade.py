"""An online upgrade: the previous release's dispatchers and business code run against a
schema that this release's ``outbox migrate`` upgrades under them; then this release's
dispatcher replaces theirs (migrate, then deploy). No job is lost or delivered twice, the
previous release keeps working on the migrated schema until it is replaced, and the
longest business transaction during the migration is reported.

The previous release is read from this repository's history (``git archive``): a clone
has it; a source tree without its history cannot run this test and says so.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

import outbox
from outbox.migrate import latest_version

from ..integration.helpers import wait_until

# The last release before the migrations this one brings (schema version 9).
PREVIOUS_RELEASE = "c07f2484c2e58ef8b7fccbbe97183a2b1b5c379f"
PREVIOUS_VERSION = 9
REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "upgrade_worker.py"


@pytest.fixture(scope="module")
def previous_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tree = tmp_path_factory.mktemp("previous-release")
    try:
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", PREVIOUS_RELEASE, "outbox", "migrations"],
            capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise AssertionError(
            f"the online-upgrade test needs release {PREVIOUS_RELEASE[:12]} from this "
            f"repository's git history (a full clone has it): {exc}") from exc
    subprocess.run(["tar", "xf", "-", "-C", str(tree)], input=archive, check=True)
    return tree


def _env(tree: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree if tree is not None else REPO)
    return env


def _start(tree: Path | None, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(WORKER), *args], env=_env(tree),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(process: subprocess.Popen[str], what: str) -> str:
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0, f"{what} exited {process.returncode}: {err[-2000:]}"
    return out


def _count(dsn: str, query: str, schema: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(sql.SQL(query).format(schema=sql.Identifier(schema))).fetchone()
        return int(row[0]) if row else 0


def test_the_previous_release_runs_on_through_the_migration_and_is_replaced(
        dsn: str, previous_release: Path) -> None:
    schema = f"upgrade_{os.getpid()}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA IF NOT EXISTS upgrade_provider")
        conn.execute("DROP TABLE IF EXISTS upgrade_provider.deliveries")
        conn.execute("CREATE TABLE upgrade_provider.deliveries "
                     "(key text PRIMARY KEY, times integer NOT NULL)")
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
    old = subprocess.run([sys.executable, str(WORKER), "migrate", dsn, schema],
                         env=_env(previous_release), capture_output=True, text=True,
                         check=True, timeout=120)
    migrated: dict[str, Any] = json.loads(old.stdout)
    assert migrated["applied"] == list(range(1, PREVIOUS_VERSION + 1))
    assert migrated["from"].startswith(str(previous_release)), migrated
    delivered = "SELECT count(*) FROM upgrade_provider.deliveries"

    old_dispatchers = [_start(previous_release, "dispatch", dsn, schema) for _ in range(2)]
    business = _start(previous_release, "enqueue", dsn, schema, "order")
    new_dispatcher: subprocess.Popen[str] | None = None
    try:
        wait_until(lambda: _count(dsn, delivered, schema) >= 200, timeout=60,
                   what="the previous release delivering")
        with psycopg.connect(dsn, autocommit=True) as conn:
            started = time.monotonic()
            applied = outbox.migrate(conn, schema=schema)
            migration_seconds = time.monotonic() - started
        assert applied == list(range(PREVIOUS_VERSION + 1, latest_version() + 1))
        # The previous release goes on delivering on the migrated schema...
        after = _count(dsn, delivered, schema)
        wait_until(lambda: _count(dsn, delivered, schema) >= after + 200, timeout=60,
                   what="the previous release delivering on the migrated schema")
        # ...until this release's dispatcher is deployed and theirs are stopped.
        new_dispatcher = _start(None, "dispatch", dsn, schema)
        for process in old_dispatchers:
            _finish(process, "a previous-release dispatcher")
        result = json.loads(_finish(business, "the previous release's business code"))
        enqueued = int(result["enqueued"])
        wait_until(lambda: _count(dsn, delivered, schema) >= enqueued, timeout=120,
                   what="every enqueued job delivered")
        _finish(new_dispatcher, "this release's dispatcher")
        new_dispatcher = None
    finally:
        for process in [*old_dispatchers, business, *(
                [new_dispatcher] if new_dispatcher else [])]:
            if process.poll() is None:
                process.kill()
                process.communicate()
    with psycopg.connect(dsn, autocommit=True) as conn:
        twice = conn.execute("SELECT key, times FROM upgrade_provider.deliveries "
                             "WHERE times > 1").fetchall()
        assert twice == []
        statuses: dict[str, int] = dict(conn.execute(sql.SQL(
            "SELECT status, count(*) FROM {}.jobs GROUP BY status").format(
                sql.Identifier(schema))).fetchall())
        ledger = conn.execute(sql.SQL("SELECT count(*) FROM {}.effect_results").format(
            sql.Identifier(schema))).fetchone()
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
    assert _count_rows(statuses) == enqueued and statuses == {"done": enqueued}
    assert ledger == (enqueued,)
    print(f"online upgrade: {enqueued} jobs, migration {migration_seconds:.3f} s, the "
          f"longest business transaction of the run {result['longest']:.3f} s")


def _count_rows(statuses: dict[str, int]) -> int:
    return sum(statuses.values())
