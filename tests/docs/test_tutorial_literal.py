"""The tutorial's commands, run as the page shows them (its ``sh`` blocks, in order, in a
directory holding the files it says to save), with their output checked against the
page's ``text`` blocks: what a reader types, and what they are told they will see.

Only two steps are swapped for the test's own: the database is a fresh one of the test
server instead of ``outbox dev-server`` (tests/operations covers that command), and
``outbox web`` (it runs until Ctrl-C) is left to tests/docs/test_tutorial.py, which drives
the dashboard in a browser."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..test_readme import ROOT
from .support import hearing_ctrl_c, own_database

PAGE = ROOT / "docs" / "tutorial" / "index.md"
CODE = ROOT / "docs" / "tutorial" / "code"
_FENCE = re.compile(r"^```(?P<lang>sh|text)\n(?P<body>.*?)^```", re.S | re.M)
BIN = Path(sys.executable).parent


def _blocks() -> list[tuple[str, str]]:
    return [(m["lang"], m["body"]) for m in _FENCE.finditer(PAGE.read_text())]


def _after(blocks: list[tuple[str, str]], command: str) -> str:
    """The ``text`` block right after the ``sh`` block holding ``command``."""
    for (lang, body), following in itertools.pairwise(blocks):
        if lang == "sh" and command in body and following[0] == "text":
            return following[1]
    raise AssertionError(f"{PAGE.name}: no output shown after {command!r}")


def _command(blocks: list[tuple[str, str]], command: str) -> str:
    """The page's own line for ``command`` (without its trailing comment)."""
    for lang, body in blocks:
        for line in body.splitlines():
            if lang == "sh" and line.startswith(command):
                return line.split("  #", 1)[0].strip()
    raise AssertionError(f"{PAGE.name}: no {command!r} in its shell blocks")


@pytest.fixture
def empty_database(dsn: str) -> Iterator[str]:
    """A database of its own, not yet migrated (the tutorial's step 2 migrates it)."""
    with own_database(dsn, "tutorial") as conninfo:
        yield conninfo


def _sh(line: str, cwd: Path, env: dict[str, str], timeout: float = 60
        ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


def _status_labels(text: str) -> list[str]:
    return [line.split()[0] for line in text.splitlines()
            if re.match(r"^  [a-z]+ +\d+$", line)]


def test_the_tutorial_as_written(empty_database: str, tmp_path: Path) -> None:
    blocks = _blocks()
    for name in ("fakes.py", "shop.py"):  # "Save this as ..."
        shutil.copy(CODE / name, tmp_path / name)
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
           "OUTBOX_DATABASE_URL": empty_database}
    env.pop("PYTHONPATH", None)

    migrated = _sh(_command(blocks, "outbox migrate"), tmp_path, env)
    assert migrated.returncode == 0, migrated.stderr
    shown = _after(blocks, "outbox migrate").splitlines()[-1]
    assert migrated.stdout.strip() == shown, (migrated.stdout, shown)

    with subprocess.Popen(hearing_ctrl_c(["python", "fakes.py"]), cwd=tmp_path, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) as fakes:
        try:
            assert fakes.stdout is not None
            printed = [fakes.stdout.readline() for _ in range(3)]
            shown = next(body for lang, body in blocks
                         if lang == "text" and "Ctrl-C stops them." in body)
            assert [re.sub(r":\d+ ", ":PORT ", line.strip()) for line in printed] == \
                [re.sub(r":\d+ ", ":PORT ", line) for line in shown.strip().splitlines()]
            for line in printed[:2]:  # "paste them into your first terminal"
                for pair in line.split()[1:]:
                    key, _, value = pair.partition("=")
                    env[key] = value
            _the_rest(blocks, tmp_path, env)
        finally:
            fakes.send_signal(signal.SIGINT)  # Ctrl-C
            fakes.wait(10)


def _the_rest(blocks: list[tuple[str, str]], cwd: Path, env: dict[str, str]) -> None:
    placed = _sh(_command(blocks, "python shop.py"), cwd, env)
    assert placed.returncode == 0, placed.stderr
    assert placed.stdout.strip() == _after(blocks, "python shop.py").strip()

    killed = _sh(_command(blocks, "outbox run shop:dispatcher &"), cwd, env)
    start_line = killed.stderr.strip().splitlines()[0]
    shown = _after(blocks, "outbox run shop:dispatcher &").strip()
    assert re.sub(r"Dispatcher \S+ on \S+", "", start_line) == \
        re.sub(r"Dispatcher \S+ on \S+", "", shown), (start_line, shown)
    assert "stripe" not in killed.stderr  # the SDK's request lines stay quiet at INFO

    status = _sh(_command(blocks, "outbox status"), cwd, env)
    assert status.returncode == 0, status.stderr
    shown_status = _after(blocks, "outbox status")
    assert _status_labels(status.stdout) == _status_labels(shown_status), status.stdout
    assert status.stdout.splitlines()[0] == shown_status.splitlines()[0]

    # "Now start the dispatcher again (it runs until Ctrl-C)"
    line = next(line for lang, body in blocks if lang == "sh" for line in body.splitlines()
                if line.split("  #", 1)[0].strip() == "outbox run shop:dispatcher")
    again = subprocess.Popen(hearing_ctrl_c(["bash", "-c", "exec " + line]),
                             cwd=cwd, env=env, text=True, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            now = _sh("outbox status", cwd, env).stdout
            if re.search(r"^  done +40$", now, re.M) and re.search(r"^  pending +0$", now, re.M):
                break
            time.sleep(0.5)  # polling a command's output: there is no event to wait on
        else:
            pytest.fail(f"not every job done within 90 s:\n{now}")
    finally:
        again.send_signal(signal.SIGINT)  # Ctrl-C
        _, err = again.communicate(timeout=60)
    done_shown = [body for lang, body in blocks
                  if lang == "text" and re.search(r"^  done +40$", body, re.M)]
    assert done_shown and _status_labels(done_shown[0]) == _status_labels(now)
    counters = json.loads(err.strip().splitlines()[-1])
    assert counters["failed"] == 0 and counters["done"] >= 1, counters
