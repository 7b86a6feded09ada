"""The dispatcher processes of a chaos run: started, killed, frozen, replaced, stopped.

Each worker lives in a numbered slot; a killed worker is replaced in its slot at once by
a new process with a new tag (``<run>-<slot>.<generation>``). Every process the pool
starts is reaped (``communicate()``, which also closes its pipe) and none outlives
``cleanup()``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from .settings import ENV_VARIABLE, WorkerSettings

__all__ = ["WorkerPool", "WorkerProcess"]

_PROJECT_ROOT = Path(__file__).resolve().parents[2]
_LOG_TAIL = 6000
_READY_SECONDS = 20.0


@dataclass
class WorkerProcess:
    """One dispatcher process: its slot, tag (its ``worker_id``), process and log."""

    slot: int
    settings: WorkerSettings
    proc: subprocess.Popen[bytes]
    log_path: Path
    started_at: float = field(default_factory=time.monotonic)
    frozen: bool = False
    # spoken for: being killed, or thawed and awaiting its graceful stop; no other fault
    # may pick it, and its exit is no surprise
    doomed: bool = False

    @property
    def tag(self) -> str:
        """The worker's id: ``claimed_by`` of its jobs, suffix of its connection names."""
        return self.settings.tag

    @property
    def pid(self) -> int:
        """The process id."""
        return self.proc.pid

    def log_tail(self) -> str:
        """The end of the worker's log (stderr)."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return text[-_LOG_TAIL:]


@dataclass
class WorkerPool:
    """``size`` worker slots running ``python -m effects.chaos.worker``.

    ``stats`` holds the JSON counters of workers that exited after SIGTERM (a killed
    worker prints none); ``problems`` what went wrong with a process on its own: an
    unexpected exit, a non-zero status, no exit within the stop timeout.
    """

    template: WorkerSettings
    size: int
    log_dir: Path
    run_id: str
    ready: Callable[[WorkerProcess], bool] = lambda worker: True
    started: int = 0
    killed: int = 0
    stats: list[dict[str, float]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    _live: dict[int, WorkerProcess] = field(default_factory=dict)
    _every: list[WorkerProcess] = field(default_factory=list)  # for the last cleanup
    _generations: dict[int, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start_all(self) -> None:
        """Start one worker per slot."""
        for slot in range(self.size):
            self.start(slot)

    def start(self, slot: int) -> WorkerProcess:
        """Start a worker in ``slot`` (replacing nothing: the slot must be empty)."""
        with self._lock:
            generation = self._generations.get(slot, 0)
            self._generations[slot] = generation + 1
            tag = f"{self.run_id}-{slot}.{generation}"
            # A fleet worker tells it runs by a file (see WorkerSettings.ready_file).
            ready_file = str(self.log_dir / f"worker-{tag}.ready") \
                if self.template.targets else ""
            settings = replace(self.template, tag=tag, ready_file=ready_file)
            worker = self._spawn(slot, settings)
            self._live[slot] = worker
            self._every.append(worker)
            self.started += 1
            return worker

    def _spawn(self, slot: int, settings: WorkerSettings) -> WorkerProcess:
        log_path = self.log_dir / f"worker-{settings.tag}.log"
        python_path = os.pathsep.join(p for p in (str(_PROJECT_ROOT),
                                                  os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, ENV_VARIABLE: settings.to_json(), "PYTHONPATH": python_path}
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "effects.chaos.worker"], cwd=self.log_dir, env=env,
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
            )
        return WorkerProcess(slot, settings, proc, log_path)

    def live(self) -> list[WorkerProcess]:
        """The workers alive now, by slot."""
        with self._lock:
            return [self._live[slot] for slot in sorted(self._live)]

    def pick(self, slot: int, min_age: float = 0.0) -> WorkerProcess | None:
        """The worker in ``slot``, or the next slot's: not frozen, and up for ``min_age``
        seconds if any is (a worker still starting holds nothing worth a fault)."""
        with self._lock:
            order = [self._live.get((slot + offset) % self.size) for offset in range(self.size)]
        awake = [w for w in order if w is not None and not w.frozen and not w.doomed]
        now = time.monotonic()
        settled = [w for w in awake if now - w.started_at >= min_age]
        candidates = settled or awake
        return candidates[0] if candidates else None

    def kill(self, worker: WorkerProcess) -> None:
        """SIGKILL ``worker`` (``replace`` reaps it and starts its successor)."""
        worker.doomed = True
        worker.proc.send_signal(signal.SIGKILL)
        with self._lock:
            self.killed += 1

    def replace(self, worker: WorkerProcess) -> WorkerProcess:
        """Reap a killed ``worker`` and start its replacement in its slot."""
        worker.proc.communicate()
        self._remove(worker)
        return self.start(worker.slot)

    def _remove(self, worker: WorkerProcess) -> None:
        with self._lock:
            if self._live.get(worker.slot) is worker:
                del self._live[worker.slot]

    def freeze(self, worker: WorkerProcess) -> None:
        """SIGSTOP ``worker``: it holds its claims and connections, and does nothing."""
        worker.frozen = True
        worker.proc.send_signal(signal.SIGSTOP)

    def thaw(self, worker: WorkerProcess) -> None:
        """SIGCONT a frozen worker (if it is still the one in its slot)."""
        if worker.frozen and worker.proc.poll() is None:
            worker.proc.send_signal(signal.SIGCONT)
        worker.frozen = False

    def replace_exited(self) -> list[WorkerProcess]:
        """Replace workers that exited on their own (none should); record why."""
        exited = [w for w in self.live() if not w.doomed and w.proc.poll() is not None]
        for worker in exited:
            worker.proc.communicate()
            self.problems.append(f"worker {worker.tag} exited on its own with status "
                                 f"{worker.proc.returncode}: {worker.log_tail()}")
            self._remove(worker)
            self.start(worker.slot)
        return exited

    def retire(self, worker: WorkerProcess, timeout: float) -> dict[str, float] | None:
        """SIGTERM ``worker`` (a graceful stop, as in a deploy), collect its counters and
        start its successor in its slot; the counters, or None if it printed none.
        The worker must be spoken for (``doomed``) so that no other fault picks it."""
        with self._lock:
            if self._live.get(worker.slot) is not worker:
                return None  # gone meanwhile
        self.thaw(worker)
        self._await_ready(worker)
        worker.proc.send_signal(signal.SIGTERM)
        stats = self._collect(worker, timeout)
        self._remove(worker)
        self.start(worker.slot)
        return stats

    def stop_all(self, timeout: float) -> None:
        """SIGTERM every worker (thawing frozen ones) and collect what each printed."""
        workers = self.live()
        for worker in workers:
            self.thaw(worker)
            self._await_ready(worker)
            worker.proc.send_signal(signal.SIGTERM)
        for worker in workers:
            self._collect(worker, timeout)
            self._remove(worker)

    def _await_ready(self, worker: WorkerProcess) -> None:
        """Wait (bounded) until the worker runs its dispatcher, whose SIGTERM handler
        makes a graceful stop; before that, SIGTERM would just end the process."""
        deadline = time.monotonic() + _READY_SECONDS
        while worker.proc.poll() is None and time.monotonic() < deadline:
            if self.ready(worker):
                return
            time.sleep(0.1)

    def _collect(self, worker: WorkerProcess, timeout: float) -> dict[str, float] | None:
        """Wait for a worker sent SIGTERM; keep and return the counters it printed."""
        try:
            out, _ = worker.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            worker.proc.send_signal(signal.SIGUSR1)  # the worker dumps its stacks
            time.sleep(1.0)
            worker.proc.kill()
            worker.proc.communicate()
            self.problems.append(f"worker {worker.tag} did not stop within {timeout:.0f} s "
                                 f"of SIGTERM (its dispatcher's stop_timeout is "
                                 f"{self.template.stop_timeout:.0f} s); its threads' stacks, "
                                 f"dumped before it was killed, end its log: "
                                 f"{worker.log_tail()}")
            return None
        lines = [line for line in out.decode(errors="replace").splitlines() if line.startswith("{")]
        if worker.proc.returncode != 0 or not lines:
            self.problems.append(f"worker {worker.tag} exited with status "
                                 f"{worker.proc.returncode} after SIGTERM: {worker.log_tail()}")
            return None
        stats: dict[str, float] = json.loads(lines[-1])
        with self._lock:
            self.stats.append(stats)
        return stats

    def cleanup(self) -> None:
        """Kill and reap every worker ever started that is still alive or unreaped
        (SIGKILL also ends a stopped one)."""
        with self._lock:
            every = list(self._every)
        for worker in every:
            if worker.proc.returncode is None:
                if worker.proc.poll() is None:
                    worker.proc.kill()
                worker.proc.communicate()
            elif worker.proc.stdout is not None and not worker.proc.stdout.closed:
                worker.proc.stdout.close()
            self._remove(worker)

    def total(self, counter: str) -> int:
        """A counter summed over the workers that reported."""
        return int(sum(stats.get(counter, 0) for stats in self.stats))
