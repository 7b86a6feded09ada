"""The stop watch (``outbox._dispatch.severance.StopWatch``): one policy, one program, the
same decisions whether ``Dispatcher`` runs it on a thread (``drive``) or
``AsyncDispatcher`` as a task of its loop (``drive_async``).

Each case plays the run's side (a stop, the claimer leaving its loop, the run returning)
against the watch's program under both drivers, and compares what the watch did: the
waits it asked for (their seconds), whether it left what is held to its leases, whether it
cut the connections, and whether it woke the claimer. The run's side acts on what the
watch asked for (a ``Wait`` on the run's return of so many seconds), never on time: a
wait it must outlast is long, one that must run out is short.
(With a real database hanging, ``tests/failover/test_frozen.py`` shows the same for both
dispatchers end to end.)
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from outbox._dispatch import severance as severance_module
from outbox._dispatch.counting import DispatchStats
from outbox._dispatch.runtime import Program, Wait, drive, drive_async
from outbox._dispatch.severance import STOP_CHECK, Severance, StopWatch
from outbox._dispatch.signals import LoopEvent
from outbox._dispatch.state import SharedState
from outbox.observe import DispatchObserver

WITHIN = 30.0  # generous: a loaded machine


class Counted(Severance):
    """A severance that counts its cuts (there are no connections to cut here)."""

    def __init__(self) -> None:
        super().__init__("test-stop-watch")
        self.severed = 0

    def sever(self) -> int:
        self.severed += 1
        return 0


def recorded(program: Program[None], seen: list[Any],
             noted: Callable[[], None] = lambda: None) -> Program[None]:
    """``program``, its instructions noted in ``seen`` as it yields them (then
    ``noted()``)."""
    instruction = next(program)
    while True:
        seen.append(instruction)
        noted()
        try:
            answer = yield instruction
        except BaseException as exc:  # thrown in by the driver: passed on
            try:
                instruction = program.throw(exc)
            except StopIteration:
                return
        else:
            try:
                instruction = program.send(answer)
            except StopIteration:
                return


# The run's side: "stop" (request_stop), "left" (the claimer left its loop), a number
# (wait until the watch waits that long for the run to return), "return" (run() returned).
Act = str | float


def _outcome(watch: StopWatch, state: SharedState[Any], severance: Counted,
             seen: list[Any], returned: Any) -> tuple[Any, ...]:
    waits = [w.seconds for w in seen if isinstance(w, Wait) and w.event is returned]
    return (waits, state.abandoned, watch.cut, severance.severed, state.wake.is_set(),
            watch.stopped_at is not None)


def _watched(event: Callable[[], Any], stop_timeout: float,
             ) -> tuple[StopWatch, SharedState[Any], Counted]:
    state = SharedState(DispatchStats(), DispatchObserver(), 4, event)
    severance = Counted()
    return severance.watch(state, stop_timeout, 30.0, event), state, severance


def _waited_for(seen: list[Any], returned: Any, seconds: float) -> bool:
    return any(isinstance(w, Wait) and w.event is returned and w.seconds == seconds
               for w in list(seen))


def _act(watch: StopWatch, state: SharedState[Any], act: Act) -> None:
    if act == "stop":
        state.request_stop()
    elif act == "left":
        watch.claimer_left()
    elif act == "return":
        watch.returned()


def on_a_thread(acts: Sequence[Act], stop_timeout: float) -> tuple[Any, ...]:
    watch, state, severance = _watched(threading.Event, stop_timeout)
    seen: list[Any] = []
    noted = threading.Event()
    thread = threading.Thread(target=drive,
                              args=(recorded(watch.watching(), seen, noted.set),))
    thread.start()
    for act in acts:
        if isinstance(act, float):
            deadline = time.monotonic() + WITHIN
            while True:
                noted.clear()  # before the look: a note after it is not missed
                if _waited_for(seen, watch._returned, act):
                    break
                assert noted.wait(deadline - time.monotonic()), f"no wait of {act}s"
        else:
            _act(watch, state, act)
    thread.join(WITHIN)
    assert not thread.is_alive(), "the watch did not end"
    return _outcome(watch, state, severance, seen, watch._returned)


async def _noted(noted: asyncio.Event, seen: list[Any], watch: StopWatch,
                 seconds: float) -> None:
    """Until the watch (a task) waits ``seconds`` for the run to return."""
    async with asyncio.timeout(WITHIN):
        while True:
            noted.clear()
            if _waited_for(seen, watch._returned, seconds):
                return
            await noted.wait()


def as_a_task(acts: Sequence[Act], stop_timeout: float) -> tuple[Any, ...]:
    async def main() -> tuple[Any, ...]:
        watch, state, severance = _watched(LoopEvent, stop_timeout)
        seen: list[Any] = []
        noted = asyncio.Event()
        task = asyncio.get_running_loop().create_task(
            drive_async(recorded(watch.watching(), seen, noted.set)))
        for act in acts:
            if isinstance(act, float):
                await _noted(noted, seen, watch, act)
            else:
                _act(watch, state, act)
        await asyncio.wait_for(task, WITHIN)
        return _outcome(watch, state, severance, seen, watch._returned)

    return asyncio.run(main())


SHORT, LONG = 0.05, WITHIN  # a wait that runs out; one that the run's side ends first

# stop_timeout, CUT_AFTER, the run's acts; then: the waits on the run's return, abandoned,
# cut, cuts, woken, stop seen.
CASES: dict[str, tuple[float, float, list[Act], tuple[Any, ...]]] = {
    # The run ended without a stop (its start failed): nothing to do.
    "no stop": (SHORT, SHORT, ["return"], ([], False, False, 0, False, False)),
    # The run returned within stop_timeout of the stop: nothing to do.
    "returned in time": (LONG, SHORT, ["stop", LONG, "return"],
                         ([LONG], False, False, 0, True, True)),
    # The claimer is blocked on the database: nobody else will abandon, the watch does,
    # then cuts at once and wakes the claimer's wait.
    "claimer blocked": (SHORT, LONG, ["stop"], ([SHORT], True, True, 1, True, True)),
    # The claimer left its loop (the drain abandons at its own deadline): the watch
    # gives the run CUT_AFTER more, and it returned meanwhile.
    "drain was enough": (SHORT, LONG, ["stop", "left", LONG, "return"],
                         ([SHORT, LONG], False, False, 0, True, True)),
    # The claimer left, but a part still waits for the database past CUT_AFTER: cut,
    # without an abandon of the watch's own.
    "a part still waits": (SHORT, SHORT, ["stop", "left"],
                           ([SHORT, SHORT], False, True, 1, True, True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_watch_decides_the_same_on_a_thread_and_as_a_task(
    monkeypatch: pytest.MonkeyPatch, case: str,
) -> None:
    stop_timeout, cut_after, acts, expected = CASES[case]
    monkeypatch.setattr(severance_module, "CUT_AFTER", cut_after)
    assert (on_a_thread(acts, stop_timeout) == as_a_task(acts, stop_timeout)
            == expected)


def test_a_task_of_the_watch_cancelled_ends_it_without_a_cut() -> None:
    """``AsyncDispatcher``'s run ends the watch's task by cancelling it: nothing more is
    done, whatever phase it was in."""

    async def main() -> tuple[bool, int]:
        watch, state, severance = _watched(LoopEvent, WITHIN)
        seen: list[Any] = []
        noted = asyncio.Event()
        task = asyncio.get_running_loop().create_task(
            drive_async(recorded(watch.watching(), seen, noted.set)))
        state.request_stop()
        await _noted(noted, seen, watch, WITHIN)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return watch.cut, severance.severed

    assert asyncio.run(main()) == (False, 0)


def test_without_a_stop_the_watch_looks_for_the_runs_return_every_stop_check() -> None:
    """Before a stop, the watch waits on the stop with ``STOP_CHECK`` and looks between
    two waits whether the run returned: it never waits on a stop for ever."""
    watch, state, _ = _watched(threading.Event, WITHIN)
    seen: list[Any] = []
    program = recorded(watch.watching(), seen)
    assert next(program) == Wait(state.stopping, STOP_CHECK)
    assert program.send(False) == Wait(state.stopping, STOP_CHECK)
    watch.returned()
    with pytest.raises(StopIteration):
        program.send(False)
