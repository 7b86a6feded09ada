"""Graphile Worker's driver (``peers/graphile/drain.js``) from Python: its settings, its
installation into a cache directory outside the repository, its reports and their checks.
Apart from the section (``benchmarks/graphile.py``) so that the parsing is tested without
the benchmarks' own dependencies."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import select
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from psycopg.conninfo import conninfo_to_dict

log = logging.getLogger("benchmarks.graphile")

PEER = Path(__file__).resolve().parent / "peers" / "graphile"
DRIVER = PEER / "drain.js"
PACKAGE_FILES = ("package.json", "package-lock.json")
VERSION = "0.17.3"
INSTALL_HINT = ("install Node.js (18 or later) and npm, e.g. `apt-get install nodejs npm` "
                "on Debian, or from https://nodejs.org/, then run this section again")


class GraphileError(RuntimeError):
    """Graphile Worker's driver failed, said something unreadable, or drained wrongly."""


@dataclass(frozen=True)
class GraphileSettings:
    """Graphile Worker's options for the drain, each a ``preset.worker`` option:
    ``concurrency`` (``concurrentJobs``), ``pool`` (the connections of the ``pg`` pool
    given to it, its ``maxPoolSize``), ``local_queue`` (``localQueue.size``: jobs fetched
    per query and handed out locally; -1 off), ``refetch_delay_ms``
    (``localQueue.refetchDelay.durationMs``; None: none), ``complete_batch_delay`` and
    ``fail_batch_delay`` (``completeJobBatchDelay`` / ``failJobBatchDelay``, ms: completions
    batched into one statement; -1 off, 0 the next tick), ``prepared_statements``."""

    concurrency: int = 24
    pool: int = 25
    local_queue: int = 5000
    refetch_delay_ms: int | None = None
    complete_batch_delay: int = 0
    fail_batch_delay: int = 0
    prepared_statements: bool = True

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.pool < 1:
            raise ValueError(f"graphile: concurrency and pool must be at least 1, got "
                             f"concurrency={self.concurrency} pool={self.pool}")
        if self.local_queue == 0 or self.local_queue < -1:
            raise ValueError(f"graphile: local_queue must be -1 (off) or at least 1, "
                             f"got {self.local_queue}")

    def as_json(self) -> str:
        """The settings as ``drain.js drain`` reads them."""
        return json.dumps(asdict(self), sort_keys=True)

    def describe(self) -> str:
        return " ".join(f"{k}={v}" for k, v in asdict(self).items())

    def with_options(self, options: Sequence[tuple[str, Any]]) -> GraphileSettings:
        """These settings with ``(name, value)`` pairs replacing some; a clear error for
        a name that is not one of them."""
        known = set(asdict(self))
        unknown = [name for name, _ in options if name not in known]
        if unknown:
            raise ValueError(f"graphile: unknown setting(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        return replace(self, **dict(options))


# The settings Graphile Worker's performance page recommends for throughput (a local
# queue, completions and failures batched at delay 0, concurrency 24 with a pool of 25),
# with the local queue's size chosen by `--sweep` on this machine: 5,000 drained fastest
# and with the least CPU a job at 100,000 jobs (1,000, 2,000 and 10,000 tried; at 20,000
# jobs 1,000 to 5,000 were within the noise); concurrency 4, 10 and 64, a pool of 4, a
# completion delay of 1 ms, a refetch delay and no prepared statements were all slower.
TUNED = GraphileSettings()
# Its defaults for fetching and completing (no local queue: a query per job fetched; no
# batching: a statement per job completed) at the tuned concurrency and pool.
UNTUNED = GraphileSettings(local_queue=-1, complete_batch_delay=-1, fail_batch_delay=-1)


# -- the driver's output ---------------------------------------------------------------

def parse_report(line: str | bytes, expected: str) -> dict[str, Any]:
    """One line the driver printed: a JSON object holding ``expected`` (``ready``,
    ``done`` or ``seeded``); a GraphileError saying what was wrong otherwise."""
    text = line.decode(errors="replace") if isinstance(line, bytes) else line
    text = text.strip()
    if not text:
        raise GraphileError(f"graphile driver: expected a {expected!r} report, got nothing "
                            "(did it exit?)")
    try:
        report = json.loads(text)
    except json.JSONDecodeError as e:
        raise GraphileError(f"graphile driver: expected a JSON {expected!r} report, got "
                            f"{text[:200]!r} ({e.msg} at column {e.colno})") from None
    if not isinstance(report, dict) or expected not in report:
        raise GraphileError(f"graphile driver: expected a {expected!r} report, got "
                            f"{text[:200]!r}")
    return report


def check_drain(report: dict[str, Any], jobs: int, settings: GraphileSettings) -> None:
    """A drain report must account for every job, each performed once, and a local queue
    that was asked for must have fetched in batches (else its settings were not
    applied)."""
    for name in ("performed", "distinct", "seconds", "cpu_seconds", "fetches"):
        if not isinstance(report.get(name), int | float):
            raise GraphileError(f"graphile drain report: {name!r} missing or not a number "
                                f"in {report}")
    if report["performed"] != jobs:
        raise GraphileError(f"graphile drain: performed {report['performed']} jobs, "
                            f"expected {jobs}")
    if report["distinct"] != jobs:
        raise GraphileError(f"graphile drain: performed {report['distinct']} distinct jobs "
                            f"of {jobs}: some more than once")
    if settings.local_queue > 0 and report["fetches"] == 0:
        raise GraphileError("graphile drain: local_queue was set but the local queue never "
                            "fetched: the settings did not reach the worker")


# -- installing the pinned package -------------------------------------------------------

def missing_tools() -> str | None:
    """Why the section cannot run here (node or npm not found), or None."""
    missing = [tool for tool in ("node", "npm") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found: {INSTALL_HINT}"
    return None


def cache_root() -> Path:
    """Where peers' packages are installed: outside the repository."""
    explicit = os.environ.get("OUTBOX_BENCH_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "outbox-benchmarks"


def _package_hash() -> str:
    digest = hashlib.sha256()
    for name in PACKAGE_FILES:
        digest.update((PEER / name).read_bytes())
    return digest.hexdigest()[:16]


def install(cache: Path | None = None) -> Path:
    """The ``node_modules`` directory holding the pinned Graphile Worker, installed with
    ``npm ci`` (the lock file's exact versions, no install scripts) on first use."""
    target = (cache or cache_root()) / f"graphile-worker-{VERSION}-{_package_hash()}"
    modules = target / "node_modules"
    if (modules / "graphile-worker" / "package.json").exists():
        return modules
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="graphile-", dir=target.parent))
    try:
        for name in PACKAGE_FILES:
            shutil.copy2(PEER / name, staging / name)
        log.warning("installing graphile-worker %s into %s (once)", VERSION, target)
        done = subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--ignore-scripts"],
                              cwd=staging, capture_output=True, text=True, timeout=600,
                              check=False)
        if done.returncode != 0:
            raise GraphileError(f"npm ci failed in {staging} (exit {done.returncode}):\n"
                                f"{done.stderr[-2000:]}")
        try:
            staging.rename(target)
        except OSError:
            # Another invocation installed it meanwhile; theirs is as good as ours.
            if not (modules / "graphile-worker" / "package.json").exists():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return modules


# -- one drain of Graphile Worker ------------------------------------------------------

def environment(dsn: str, modules: Path) -> dict[str, str]:
    """The driver's environment: the database as PG* variables, the installed package
    on NODE_PATH."""
    parts = conninfo_to_dict(dsn)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    for key, var in (("host", "PGHOST"), ("port", "PGPORT"), ("user", "PGUSER"),
                     ("dbname", "PGDATABASE"), ("password", "PGPASSWORD")):
        if parts.get(key):
            env[var] = str(parts[key])
    env["NODE_PATH"] = str(modules)
    return env


def read_line(proc: subprocess.Popen[bytes], deadline: float) -> bytes:
    """One line of the driver's stdout, waiting until ``deadline`` at most."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    chunks: list[bytes] = []
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise GraphileError("graphile driver: no report in time")
        ready, _, _ = select.select([fd], [], [], remaining)
        if not ready:
            continue
        byte = os.read(fd, 1)
        if not byte or byte == b"\n":
            return b"".join(chunks)
        chunks.append(byte)


def seed(dsn: str, jobs: int, modules: Path, timeout: float) -> float:
    """Graphile Worker's schema and ``jobs`` no-op jobs added with ``addJobs``; jobs/s."""
    done = subprocess.run(["node", str(DRIVER), "seed", str(jobs)], env=environment(dsn, modules),
                          capture_output=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise GraphileError(f"graphile seed failed (exit {done.returncode}):\n"
                            f"{done.stderr.decode(errors='replace')[-2000:]}")
    report = parse_report(done.stdout.strip().splitlines()[-1] if done.stdout.strip() else b"",
                          "seeded")
    return jobs / float(report["seconds"])
