"""The wheel, installed with no checkout around: the command works, the demo explains.

The wheel is built offline from this tree and installed into a fresh virtual
environment; its dependencies come from the test environment's site-packages, added as
a plain path (so that the editable checkout installed there is not)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from ._installs import build_wheel, empty_venv, run_in


@dataclass(frozen=True)
class Installed:
    wheel: Path
    bin: Path
    site: Path
    elsewhere: Path  # a working directory outside the checkout

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return run_in(self.bin, self.elsewhere, *args)


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                   check=True, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    base = tmp_path_factory.mktemp("wheel")
    wheel = build_wheel(base)
    venv = empty_venv(base)
    python = venv / "bin" / "python"
    _pip("--python", str(python), "install", "--no-deps", "--no-index", str(wheel))
    site = Path(subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True).stdout.strip())
    # After the install, so that pip never sees the checkout's own outbox as installed.
    (site / "zz_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    elsewhere = base / "elsewhere"
    elsewhere.mkdir()
    return Installed(wheel, venv / "bin", site, elsewhere)


def test_the_wheel_ships_the_packages_and_migrations_but_no_examples(installed: Installed) -> None:
    names = zipfile.ZipFile(installed.wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert "examples" not in tops and "tests" not in tops and "benchmarks" not in tops
    assert {"outbox", "effects"} <= tops
    for shipped in ("outbox/_migrations/0001_jobs.sql", "outbox/sql/claim.sql",
                    "outbox/testing/__init__.py", "outbox/py.typed"):
        assert shipped in names


def test_outbox_runs_from_the_wheel_not_the_checkout(installed: Installed) -> None:
    result = installed.run("python", "-c", "import outbox, outbox.testing; print(outbox.__file__)")
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).is_relative_to(installed.site)
    assert installed.run("python", "-c", "import examples").returncode != 0


def test_help_lists_every_command(installed: Installed) -> None:
    result = installed.run("outbox", "--help")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    for command in ("migrate", "run", "status", "retry", "demo", "chaos", "dev-server"):
        assert f"  {command} " in result.stdout, result.stdout
    assert "unavailable" not in result.stdout


def test_demo_from_a_wheel_says_in_one_line_where_it_runs(installed: Installed) -> None:
    result = installed.run("outbox", "demo")
    assert result.returncode == 1
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert "source checkout" in lines[0] and "make demo" in lines[0]


def test_demo_help_from_a_wheel_is_help_not_an_error(installed: Installed) -> None:
    result = installed.run("outbox", "demo", "--help")
    assert result.returncode == 0, result.stderr
    assert "source checkout" in result.stdout and "make demo" in result.stdout


@pytest.mark.parametrize("missing", ["nats", "confluent_kafka"])
def test_without_the_chaos_extra_chaos_is_listed_and_names_the_extra(
    installed: Installed, missing: str,
) -> None:
    # As if nats-py or confluent-kafka were not installed: a package in the venv that
    # shadows it.
    stub = installed.site / missing
    stub.mkdir(exist_ok=True)
    (stub / "__init__.py").write_text(
        f"raise ModuleNotFoundError(\"No module named '{missing}'\", name='{missing}')\n")
    try:
        listed = installed.run("outbox", "--help")
        assert listed.returncode == 0, listed.stderr
        assert "  chaos " in listed.stdout and "unavailable" not in listed.stdout
        refused = installed.run("outbox", "chaos", "--jobs", "10")
        assert refused.returncode == 1
        assert refused.stderr.strip() == (
            f"Error: outbox chaos needs {missing}, which is not installed: pip install "
            "'outbox-pg[chaos]'"), refused.stderr
    finally:
        shutil.rmtree(stub)


def test_migrate_from_the_wheel_finds_the_shipped_migrations(
    installed: Installed, dsn: str
) -> None:
    schema = f"wheel_{uuid.uuid4().hex[:8]}"
    try:
        result = installed.run("outbox", "migrate", "--dsn", dsn, "--schema", schema)
        assert result.returncode == 0, result.stderr
        assert "applied 0001" in result.stdout
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                sql.Identifier(schema)))


def test_a_plugin_that_cannot_load_explains_itself(installed: Installed) -> None:
    dist = installed.site / "broken_plugin-0.1.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[outbox.commands]\nbroken = no_such_plugin_module:command\n")
    try:
        listed = installed.run("outbox", "--help")
        assert listed.returncode == 0, listed.stderr
        assert "broken" in listed.stdout and "unavailable" in listed.stdout
        assert "  migrate " in listed.stdout
        ran = installed.run("outbox", "broken", "--some-option")
        assert ran.returncode == 1
        lines = [line for line in (ran.stdout + ran.stderr).splitlines() if line.strip()]
        assert len(lines) == 1, lines
        assert "no_such_plugin_module" in lines[0] and "Traceback" not in lines[0]
    finally:
        for path in dist.iterdir():
            path.unlink()
        dist.rmdir()
