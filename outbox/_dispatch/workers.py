"""The workers: run ``perform`` for claimed jobs, at most ``concurrency`` at once.

``Performer`` holds what both dispatchers do around one ``perform`` (the slot, the start
check, payload validation, timing, turning the result or the exception into an outcome).
``ThreadWorkers`` is ``Dispatcher``'s pool: sync effects on ``concurrency`` threads fed by
one queue, async effects as tasks on one event loop of its own (``LoopRunner``). The one
limit across both is ``SharedState.slots``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from queue import SimpleQueue
from typing import Any

from pydantic import BaseModel, ValidationError

from .. import tracing
from .._enqueue import jsonb_problem
from ..effect import Job
from ..errors import Permanent
from .settings import Settings
from .state import Held, Outcome, SharedState, Success, supervised

__all__ = ["LoopRunner", "Performer", "ThreadWorkers"]

log = logging.getLogger("outbox.dispatcher")

FAST_EFFECT = 0.001  # seconds: effects faster than this are handed to threads in runs
MAX_RUN = 64


class Performer:
    """Runs one ``perform`` and turns what happened into an outcome. Thread-safe."""

    def __init__(self, state: SharedState[Any]) -> None:
        self.state = state

    def perform_sync(self, held: Held, *, signal: bool = True, gated: bool = True) -> None:
        """On a worker thread: wait for a slot, then perform ``held`` (or hand it back).
        ``gated=False`` where the threads alone are the limit (no async effects)."""
        state = self.state
        if (state.releasing or held.lost) and not state.begin(held):
            return  # handed back or dropped without waiting for a slot
        if not gated:
            if state.begin(held):
                state.finish(held, self.call_sync(held), signal=signal)
            return
        state.slots.acquire()
        try:
            if state.begin(held):
                state.finish(held, self.call_sync(held), signal=signal)
        finally:
            state.slots.release()

    async def perform_holding_slot(self, held: Held) -> None:
        """On the event loop, holding a slot (``Slots.when_free``): perform ``held`` (or
        hand it back), then release the slot."""
        try:
            if self.state.begin(held):
                self.state.finish(held, await self.call_async(held))
        finally:
            self.state.slots.release()

    def call_sync(self, held: Held) -> Outcome:
        """Call a sync ``perform`` (already begun); never raises."""
        if held.kept_result is not None:  # performed before; only its hook failed
            return Success(held.kept_result)
        started = time.monotonic()
        try:
            if held.span is None:  # not traced: no context manager on the hot path
                result = held.effect.perform(prepare(held))
            else:
                with tracing.activated(held.span):
                    result = held.effect.perform(prepare(held))
            outcome: Outcome = Success(result_json(held.job, result))
        except BaseException as exc:
            # Every failure is an outcome to record, even SystemExit raised by an effect:
            # the job must not vanish with its thread.
            outcome = exc
        self._measured(held, started)
        return outcome

    async def call_async(self, held: Held) -> Outcome:
        """Await an async ``perform`` (already begun); never raises."""
        if held.kept_result is not None:  # performed before; only its hook failed
            return Success(held.kept_result)
        started = time.monotonic()
        try:
            if held.span is None:
                result = await held.effect.perform(prepare(held))  # type: ignore[misc]
            else:
                with tracing.activated(held.span):
                    result = await held.effect.perform(prepare(held))  # type: ignore[misc]
            outcome: Outcome = Success(result_json(held.job, result))
        except BaseException as exc:  # CancelledError included: recorded as a retry
            outcome = exc
        self._measured(held, started)
        return outcome

    def _measured(self, held: Held, started: float) -> None:
        held.duration = elapsed = time.monotonic() - started
        # A moving average; a lost update between threads is harmless.
        mean = self.state.mean_perform_seconds
        self.state.mean_perform_seconds = elapsed if mean is None else 0.9 * mean + 0.1 * elapsed


class ThreadWorkers:
    """``Dispatcher``'s workers: threads for sync effects, a loop for async ones."""

    def __init__(self, settings: Settings, state: SharedState[Any]) -> None:
        self.settings = settings
        self.state = state
        self.performer = Performer(state)

    @contextmanager
    def running(self) -> Iterator[Callable[[list[Held]], None]]:
        """Start the workers; yield a function that hands them a batch of claimed jobs.

        Sync effects run on ``concurrency`` threads fed by one C-implemented queue (no
        per-job futures); async effects run as tasks on one event loop.
        """
        queue: SimpleQueue[list[Held] | None] = SimpleQueue()
        threads = [
            threading.Thread(target=supervised(self.state, "worker", lambda: self._work(queue)),
                             name=f"outbox-worker-{n}", daemon=True)
            for n in range(self.settings.concurrency if self.settings.has_sync else 0)
        ]
        for thread in threads:
            thread.start()
        runner = LoopRunner(self.performer) if self.settings.async_names else None

        def submit(batch: list[Held]) -> None:
            sync = batch if runner is None else [h for h in batch if not h.is_async]
            for chunk in self._chunks(sync):
                queue.put(chunk)
            if runner is not None and len(sync) < len(batch):
                runner.submit([h for h in batch if h.is_async])

        try:
            yield submit
        finally:
            for _ in threads:
                queue.put(None)
            for thread in threads:
                thread.join()
            if runner is not None:
                runner.close()

    def _work(self, queue: SimpleQueue[list[Held] | None]) -> None:
        # With no async effects, the ``concurrency`` threads are the limit by themselves.
        gated = bool(self.settings.async_names)
        while (chunk := queue.get()) is not None:
            for held in chunk:
                self.performer.perform_sync(held, signal=False, gated=gated)
            self.state.outcome_ready.set()  # once per chunk: the recorder takes them all

    def _chunks(self, batch: list[Held]) -> list[list[Held]]:
        """Split a claimed batch into the units workers take from the queue.

        Slow effects go one job per unit, so every worker stays busy. Effects measured to
        take under a millisecond go in runs spread over the workers: handing over each
        job separately would cost more in thread wake-ups than the jobs themselves.
        """
        mean = self.state.mean_perform_seconds
        concurrency = self.settings.concurrency
        if mean is None or mean >= FAST_EFFECT or len(batch) <= concurrency:
            return [[held] for held in batch]
        size = min(MAX_RUN, -(-len(batch) // concurrency))
        return [batch[i:i + size] for i in range(0, len(batch), size)]


class LoopRunner:
    """An event loop on its own thread running async effects (within the slots)."""

    def __init__(self, performer: Performer) -> None:
        self._performer = performer
        self._loop = asyncio.new_event_loop()
        self._tasks: set[asyncio.Task[None]] = set()
        ready = threading.Event()
        target = supervised(performer.state, "async worker loop", lambda: self._run(ready))
        self._thread = threading.Thread(target=target, name="outbox-async", daemon=True)
        self._thread.start()
        ready.wait()

    def _run(self, ready: threading.Event) -> None:
        self._loop_thread = threading.get_ident()
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(ready.set)
        self._loop.run_forever()

    def submit(self, batch: list[Held]) -> None:
        """Schedule a batch from any thread: one wake-up of the loop per batch."""
        self._loop.call_soon_threadsafe(self._spawn, batch)

    def _spawn(self, batch: list[Held]) -> None:
        state = self._performer.state
        for held in batch:
            if (state.releasing or held.lost) and not state.begin(held):
                continue  # handed back or dropped without waiting for a slot
            state.slots.when_free(partial(self._start_soon, held))

    def _start_soon(self, held: Held) -> None:
        """Holding a slot: start ``held``'s task on the loop (from any thread)."""
        if threading.get_ident() == self._loop_thread:
            self._start(held)
        else:
            self._loop.call_soon_threadsafe(self._start, held)

    def _start(self, held: Held) -> None:
        task = self._loop.create_task(self._performer.perform_holding_slot(held))
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            self._performer.state.fail("async worker", error)

    def close(self) -> None:
        """Stop the loop once every task has finished."""

        async def finish() -> None:
            while self._tasks:
                await asyncio.gather(*list(self._tasks), return_exceptions=True)
            # As asyncio.run does: what effects hold open for the loop's lifetime (their
            # connections) is closed on the loop, before it closes.
            await self._loop.shutdown_asyncgens()
            self._loop.stop()

        asyncio.run_coroutine_threadsafe(finish(), self._loop)
        self._thread.join()
        self._loop.close()


def prepare(held: Held) -> Job:
    """The job as ``perform`` sees it: with ``model`` when the effect declares one."""
    model_type = getattr(held.effect, "payload_model", None)
    if model_type is None:
        return held.job
    try:
        model = model_type.model_validate(held.job.payload)
    except ValidationError as exc:
        raise Permanent(describe_validation(held.job.effect, exc)) from None
    return dataclasses.replace(held.job, model=model)


def result_json(job: Job, result: object) -> str:
    """What ``perform`` returned as JSON text the ledger can store."""
    if result is None:
        return "null"
    try:
        if isinstance(result, BaseModel):
            text = result.model_dump_json()
        else:
            text = json.dumps(result, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
        problem = jsonb_problem(text)
        if problem:
            raise ValueError(problem)
        return text
    except (TypeError, ValueError) as exc:
        # The effect has happened; refusing to record it would make it happen again.
        log.error("job %s (key %s): result is not JSON (%s); recorded without it",
                  job.id, job.key, type(exc).__name__)
        return json.dumps({"unrecorded_result": type(result).__name__})


def describe_validation(effect: str, error: ValidationError) -> str:
    """A validation error as one line naming the fields (never their values)."""
    problems = []
    for item in error.errors(include_input=False, include_url=False):
        where = ".".join(str(part) for part in item["loc"]) or "(payload)"
        problems.append(f"{where}: {item['msg']}")
    return f"payload invalid for effect {effect!r}: " + "; ".join(problems)
