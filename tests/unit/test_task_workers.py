"""``TaskWorkers``: async effects run within the slots, on as few tasks as jobs run at
once, whether the jobs queue for slots or arrive one batch at a time."""

from __future__ import annotations

import asyncio

import outbox
from outbox._dispatch.counting import DispatchStats
from outbox._dispatch.state import Held, LoopEvent, SharedState, Success
from outbox._dispatch.workers import TaskWorkers
from outbox.observe import DispatchObserver


class Counted(outbox.Effect):
    """Records the task each job ran on and how many ran at once; yields to the loop."""

    name = "test.counted"

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[object]] = set()
        self.running = self.peak = self.performed = 0
        self.target = 0
        self.reached = asyncio.Event()

    async def perform(self, job: outbox.Job) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        self.running += 1
        self.peak = max(self.peak, self.running)
        await asyncio.sleep(0)
        self.running -= 1
        self.performed += 1
        if self.performed == self.target:
            self.reached.set()


def batch(effect: Counted, first: int, count: int) -> list[Held]:
    return [Held(outbox.Job(id=n, effect=effect.name, key=f"k{n}", payload={}, attempt=1,
                            claim_version=1), effect, is_async=True)
            for n in range(first, first + count)]


async def run_batches(concurrency: int, sizes: list[int]) -> tuple[Counted, SharedState[LoopEvent],
                                                                  TaskWorkers]:
    """Hand ``sizes`` batches over one after another, each once the last is performed."""
    effect = Counted()
    state = SharedState(DispatchStats(), DispatchObserver(), concurrency, LoopEvent)
    workers = TaskWorkers(state, pool=None)
    first = 0
    for size in sizes:
        effect.target += size
        effect.reached.clear()
        jobs = batch(effect, first, size)
        state.hold(jobs)
        workers.submit(jobs)
        await effect.reached.wait()
        first += size
    await workers.join()
    return effect, state, workers


def test_jobs_queued_for_slots_run_on_the_tasks_that_free_them() -> None:
    effect, state, workers = asyncio.run(run_batches(concurrency=4, sizes=[20]))

    assert effect.performed == 20 and effect.peak == 4
    assert len(effect.tasks) == 4
    assert [type(outcome) for _, outcome in state.take_outcomes()] == [Success] * 20
    assert not workers._tasks  # joined: every task ended


def test_batches_arriving_after_the_last_finished_reuse_the_parked_tasks() -> None:
    effect, state, workers = asyncio.run(run_batches(concurrency=4, sizes=[3, 4, 2, 4]))

    assert effect.performed == 13 and effect.peak == 4
    assert len(effect.tasks) == 4  # not one task per job: finished tasks waited for more
    assert len(state.take_outcomes()) == 13
    assert not workers._tasks and not workers._parked  # join ended the parked tasks
    assert state.slots.waiting == 0
