"""``outbox dev-server``: a PostgreSQL that outlives the command that started it, with
its data kept in a directory across stop and start."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest


def outbox(*args: str, cwd: Path, expect: int = 0) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-m", "outbox.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "OUTBOX_DEV_DIR": ""})
    assert done.returncode == expect, (args, done.stdout, done.stderr)
    return done


@pytest.fixture
def project() -> Iterator[Path]:
    # Not under pytest's tmp_path: the server's own OS user (as root) must reach it.
    root = Path(tempfile.mkdtemp(prefix="outbox-devserver-"))
    root.chmod(0o755)
    try:
        yield root
    finally:
        if (root / ".outbox-dev" / "data" / "postmaster.pid").exists():
            outbox("dev-server", "stop", cwd=root, expect=0)
        shutil.rmtree(root, ignore_errors=True)


def test_the_server_outlives_start_and_keeps_its_data(project: Path) -> None:
    started = outbox("dev-server", "start", cwd=project)
    url = started.stdout.strip()
    assert url.startswith("postgresql://") and str(project / ".outbox-dev") in url
    assert 'export OUTBOX_DATABASE_URL="$(outbox dev-server url)"' in started.stderr
    # The command has exited; the server has not.
    assert outbox("dev-server", "url", cwd=project).stdout.strip() == url
    assert outbox("dev-server", "status", cwd=project).stdout.startswith("running, pid ")
    migrated = outbox("migrate", "--dsn", url, cwd=project)
    assert "applied 0001" in migrated.stdout
    with psycopg.connect(url) as conn:
        conn.execute("CREATE TABLE kept (n int); INSERT INTO kept VALUES (7)")

    assert "data kept in" in outbox("dev-server", "stop", cwd=project).stdout
    assert outbox("dev-server", "status", cwd=project).stdout.startswith("stopped (data in ")
    refused = outbox("dev-server", "url", cwd=project, expect=1)
    assert refused.stderr.strip() == ("Error: no development server runs from .outbox-dev: "
                                      "start one with `outbox dev-server start`")

    url = outbox("dev-server", "start", cwd=project).stdout.strip()
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT n FROM kept").fetchall() == [(7,)]
    up_to_date = outbox("migrate", "--dsn", url, cwd=project)
    assert "up to date" in up_to_date.stdout


def test_another_directory_is_another_server(project: Path) -> None:
    other = outbox("dev-server", "start", "--dir", "elsewhere", cwd=project).stdout.strip()
    try:
        assert str(project / "elsewhere") in other
        outbox("dev-server", "url", cwd=project, expect=1)  # the default one is not running
    finally:
        outbox("dev-server", "stop", "--dir", "elsewhere", cwd=project)
