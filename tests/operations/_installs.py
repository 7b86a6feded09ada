"""What the install tests share: the wheel built offline from this tree, an empty venv to
install it into, and running a command of that venv from outside the checkout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check"]


def build_wheel(base: Path) -> Path:
    """The project's wheel, built offline (no build isolation, no index) into ``base``."""
    subprocess.run([*PIP, "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(base / "dist"), str(ROOT)],
                   check=True, capture_output=True, text=True, timeout=300)
    (wheel,) = (base / "dist").glob("outbox_pg-*.whl")
    return wheel


def empty_venv(base: Path) -> Path:
    """A new virtual environment without pip (the test's pip installs into it)."""
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    return venv


def run_in(bin_dir: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``args[0]`` of ``bin_dir`` run in ``cwd``, with no path or venv of the checkout's."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(bin_dir / args[0]), *args[1:]], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
