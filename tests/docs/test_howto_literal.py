"""Two how-to guides a newcomer reaches for first, followed literally: "Testing your
effects" (docs/how-to/testing.md) and "Recurring effects" (docs/how-to/schedules.md).

Each page's blocks are taken in order, as a reader copies them: its ``python`` blocks
saved where the page says (one test file) or run as scripts with ``dsn`` given, its
``sh`` blocks run by bash in that directory, and what a shell block prints (stdout and
stderr, as a terminal shows them) compared with the ``text`` block the page shows after
it. Two things are the test's own: the database is a fresh one of the test server, and
``OUTBOX_TEST_DSN`` points the page's pytest run at that server instead of starting an
embedded one (tests/testing covers the embedded start)."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import psycopg
import pytest

import outbox

from ..test_readme import ROOT
from .support import own_database

HOW_TO = ROOT / "docs" / "how-to"
# Top-level fences only (a fence indented in a list is not a step of these pages).
_FENCE = re.compile(r"^```(?P<lang>python|sh|text)\n(?P<body>.*?)^```", re.S | re.M)
BIN = Path(sys.executable).parent
_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00")
_SECONDS = re.compile(r" in \d+\.\d+s$", re.M)


def _blocks(page: Path) -> list[tuple[str, str]]:
    return [(m["lang"], m["body"]) for m in _FENCE.finditer(page.read_text())]


@pytest.fixture
def database(dsn: str) -> Iterator[str]:
    """A database of its own, migrated (as the tutorial leaves the reader's)."""
    with own_database(dsn, "howto") as url:
        with psycopg.connect(url, autocommit=True) as conn:
            outbox.migrate(conn)
        yield url


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
           "PYTHONUNBUFFERED": "1", **extra}  # unbuffered: lines in a terminal's order
    for name in ("PYTHONPATH", "PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER"):
        env.pop(name, None)
    return env


def _sh(body: str, cwd: Path, env: dict[str, str]) -> str:
    """A shell block run as typed; what the terminal shows (stdout and stderr)."""
    done = subprocess.run(["bash", "-e", "-c", body], cwd=cwd, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120,
                          check=False)
    assert done.returncode == 0, f"{body}\nfailed:\n{done.stdout[-3000:]}"
    return done.stdout


def _shells_with_output(blocks: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Each ``sh`` block and the ``text`` block the page shows right after it."""
    return [(body, after) for (lang, body), (after_lang, after)
            in itertools.pairwise(blocks) if lang == "sh" and after_lang == "text"]


def test_testing_your_effects_as_written(dsn: str, tmp_path: Path) -> None:
    page = HOW_TO / "testing.md"
    blocks = _blocks(page)
    saved_as = re.search(r"in one file, `([^`]+)`", page.read_text())
    assert saved_as, f"{page.name}: no 'in one file, `NAME`' saying where the blocks go"
    python = [body for lang, body in blocks if lang == "python"]
    assert len(python) == 2, python
    (tmp_path / saved_as[1]).write_text("\n\n".join(python))
    env = _env(OUTBOX_TEST_DSN=dsn)

    shells = _shells_with_output(blocks)
    assert len(shells) == 1, shells
    command, shown = shells[0]
    assert saved_as[1] in command
    printed = _sh(command, tmp_path, env)
    assert _SECONDS.sub(" in Xs", printed.strip()) == _SECONDS.sub(" in Xs", shown.strip()), \
        printed


def _next_wall_clock(now: datetime, zone: str, hour: int, *, first_of_month: bool = False
                     ) -> datetime:
    """The next instant after ``now`` at ``hour``:00 on ``zone``'s wall clock (on the
    first of a month when asked), in UTC: what the page's cron lines mean."""
    local = now.astimezone(ZoneInfo(zone))
    day = local.replace(hour=hour, minute=0, second=0, microsecond=0, tzinfo=None)
    while True:
        slot = day.replace(tzinfo=ZoneInfo(zone))
        if slot > local and (not first_of_month or slot.day == 1):
            return slot.astimezone(UTC)
        day += timedelta(days=1)


def test_recurring_effects_as_written(database: str, tmp_path: Path) -> None:
    page = HOW_TO / "schedules.md"
    blocks = _blocks(page)
    env = _env(OUTBOX_DATABASE_URL=database)
    started = datetime.now(UTC)
    python = [body for lang, body in blocks if lang == "python"]
    assert len(python) == 2, python
    for number, body in enumerate(python):  # each saved as a script and run
        script = tmp_path / f"example_{number}.py"
        script.write_text("import os\ndsn = os.environ['OUTBOX_DATABASE_URL']\n" + body)
        done = subprocess.run([sys.executable, "-W", "error", script.name], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=120,
                              check=False)
        assert done.returncode == 0, f"{page.name} block {number + 1}:\n{done.stderr[-3000:]}"

    shells = _shells_with_output(blocks)
    assert len(shells) == 2, shells
    listed = ""
    for command, shown in shells:
        printed = _sh(command, tmp_path, env)
        assert _TIME.sub("TIME", printed.strip()) == _TIME.sub("TIME", shown.strip()), printed
        listed = listed or printed

    # The slots the listing shows are the ones the page's cron lines and time zones mean
    # ("its first slot is the next 03:00", Berlin time).
    slots = {name: datetime.fromisoformat(slot)
             for name, slot in re.findall(r"^([\w-]+): .*; next (\S+);", listed, re.M)}

    def expected(now: datetime) -> dict[str, datetime]:
        return {
            "daily-report": _next_wall_clock(now, "Europe/Berlin", 7),
            "nightly-charges": _next_wall_clock(now, "Europe/Berlin", 3),
            "invoices-shop-17": _next_wall_clock(now, "Europe/Berlin", 6,
                                                 first_of_month=True),
            "invoices-shop-18": _next_wall_clock(now, "America/New_York", 6,
                                                 first_of_month=True),
        }

    # As of the test's start, or of now for a slot that passed while it ran.
    before, after = expected(started), expected(datetime.now(UTC))
    assert sorted(slots) == sorted(before), slots
    for name, slot in slots.items():
        assert slot in (before[name], after[name]), (name, slot, before[name])
    with psycopg.connect(database) as conn:  # "removed": only the declared ones are left
        names = [r[0] for r in conn.execute("SELECT name FROM outbox.schedules ORDER BY name")]
    assert names == ["invoices-shop-17", "invoices-shop-18", "nightly-charges"], names
