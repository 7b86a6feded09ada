"""Real worker processes, started and prepared first, then released together.

A worker is described by a *setup* function, importable at module level: it runs in
the child, connects and builds what it needs, and returns a ``Prepared``: the callable
to time, and anything the parent should know before release (a port, a RSS). The
parent waits until every child is ready, starts the clock, releases them all through
their pipes, and stops the clock when the last one reports that it finished.

Children come from a forkserver that has already imported outbox and the peers, so
starting one costs a fork, not an interpreter start; none inherits the parent's
connections or threads.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.context import ForkServerContext
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event as EventType
from typing import Any

Tick = Callable[[list[int], float], None]

_PRELOAD = ["benchmarks._drain_workers", "benchmarks.wake", "benchmarks.latency",
            "benchmarks.asyncdispatch", "benchmarks.targets", "benchmarks.business"]
_context: ForkServerContext | None = None


@dataclass
class Prepared:
    """What a setup function returns: ``run`` is timed; ``info`` goes to the parent."""

    run: Callable[[], Any]
    info: Any = None


Setup = Callable[[Any], Prepared]


class WorkerFailed(RuntimeError):
    """A benchmark worker process raised, or did not answer in time."""


def context() -> ForkServerContext:
    """The shared forkserver context (preloading the worker modules once)."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
    return _context


def _child(pipe: Connection, setup: Setup, arg: Any, timeout: float) -> None:
    try:
        prepared = setup(arg)
        pipe.send(("ready", prepared.info))
        if not pipe.poll(timeout):
            return
        pipe.recv()
        # The CPU of the whole process (every thread) while it ran, beside its result.
        cpu = time.process_time()
        result = prepared.run()
        pipe.send(("done", (result, time.process_time() - cpu)))
    except BaseException:
        pipe.send(("error", traceback.format_exc()))
    finally:
        pipe.close()


@dataclass
class Released:
    """What one released run measured: wall seconds from release to the last finish;
    each worker's result, its ``info`` and the CPU seconds its process used running."""

    seconds: float
    results: list[Any]
    infos: list[Any] = field(default_factory=list)
    cpu_seconds: list[float] = field(default_factory=list)


def _receive(pipe: Connection, expected: str, timeout: float) -> Any:
    if not pipe.poll(timeout):
        raise WorkerFailed(f"no {expected!r} from a worker within {timeout:.0f}s")
    kind, value = pipe.recv()
    if kind == "error":
        raise WorkerFailed(f"a worker failed:\n{value}")
    if kind != expected:
        raise WorkerFailed(f"a worker said {kind!r}, expected {expected!r}")
    return value


def start(setup: Setup, arg: Any, timeout: float) -> tuple[BaseProcess, Connection]:
    """Start one prepared worker; it waits for ``release``."""
    ours, theirs = context().Pipe()
    process = context().Process(target=_child, args=(theirs, setup, arg, timeout), daemon=True)
    process.start()
    theirs.close()
    return process, ours


def stop(processes: Sequence[BaseProcess], grace: float = 10.0) -> None:
    """Join each worker we started; terminate one that overstays ``grace`` seconds."""
    deadline = time.monotonic() + grace
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.terminate()
            process.join(5.0)


def _collect(pipes: list[Connection], deadline: float, tick: tuple[float, Tick] | None,
             pids: list[int], started: float) -> tuple[list[tuple[Any, float]], float]:
    """Each worker's result and CPU seconds, and the moment the last one arrived."""
    position = {id(pipe): i for i, pipe in enumerate(pipes)}
    results: dict[int, Any] = {}
    finished = started
    while len(results) < len(pipes):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise WorkerFailed("workers did not finish in time")
        interval = remaining if tick is None else min(remaining, tick[0])
        pending = [p for i, p in enumerate(pipes) if i not in results]
        for ready in wait(pending, timeout=interval):
            index = position[id(ready)]
            results[index] = _receive(pipes[index], "done", 0)
            finished = time.perf_counter()
        if tick is not None and len(results) < len(pipes):
            tick[1](pids, time.perf_counter() - started)
    return [results[i] for i in range(len(pipes))], finished


def run_released(setup: Setup, args: Sequence[Any], *, timeout: float,
                 tick: tuple[float, Tick] | None = None,
                 before_release: Callable[[list[int]], None] | None = None) -> Released:
    """Run ``setup(arg)`` in one process per arg, release them together, time them.

    ``before_release(pids)`` runs once all are ready; ``tick=(interval, callback)``
    calls ``callback(pids, elapsed)`` every ``interval`` seconds while they run (the
    memory benchmark samples RSS with them).
    """
    started = [start(setup, arg, timeout) for arg in args]
    processes = [p for p, _ in started]
    pipes = [pipe for _, pipe in started]
    pids = [p.pid for p in processes if p.pid is not None]
    try:
        infos = [_receive(pipe, "ready", timeout) for pipe in pipes]
        if before_release is not None:
            before_release(pids)
        clock = time.perf_counter()
        for pipe in pipes:
            pipe.send("go")
        done, finished = _collect(pipes, time.monotonic() + timeout, tick, pids, clock)
        return Released(finished - clock, [result for result, _ in done], infos,
                        [cpu for _, cpu in done])
    finally:
        for pipe in pipes:
            pipe.close()
        stop(processes)


@contextlib.contextmanager
def service(setup: Setup, arg: Any, *, stop_event: EventType, timeout: float) -> Iterator[Any]:
    """Run one released worker in the background for the duration of the block.

    Yields its ``info``. On leaving the block ``stop_event`` (which ``arg`` carries) is
    set, and the worker's return is awaited for ``timeout`` seconds.
    """
    process, pipe = start(setup, arg, timeout)
    try:
        info = _receive(pipe, "ready", timeout)
        pipe.send("go")
        try:
            yield info
        finally:
            stop_event.set()
        _receive(pipe, "done", timeout)
    finally:
        pipe.close()
        stop([process])


@dataclass
class Running:
    """Workers released by ``services``: their ``info``; ``results`` once the block
    has ended (each worker's return, in order)."""

    infos: list[Any]
    pids: list[int]
    results: list[Any] = field(default_factory=list)


@contextlib.contextmanager
def services(setup: Setup, args: Sequence[Any], *, stop_event: EventType, timeout: float,
             before_release: Callable[[list[int]], None] | None = None,
             ) -> Iterator[Running]:
    """``service`` for one worker per arg, released together once all are ready
    (``before_release(pids)`` just before). On leaving the block ``stop_event`` (which
    every arg carries) is set and each worker's return awaited into ``results``."""
    started = [start(setup, arg, timeout) for arg in args]
    processes = [p for p, _ in started]
    pipes = [pipe for _, pipe in started]
    pids = [p.pid for p in processes if p.pid is not None]
    try:
        running = Running([_receive(pipe, "ready", timeout) for pipe in pipes], pids)
        if before_release is not None:
            before_release(pids)
        for pipe in pipes:
            pipe.send("go")
        try:
            yield running
        finally:
            stop_event.set()
        running.results = [_receive(pipe, "done", timeout)[0] for pipe in pipes]
    finally:
        for pipe in pipes:
            pipe.close()
        stop(processes)
