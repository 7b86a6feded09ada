"""``DaemonPool``: both dispatchers' worker threads, each started only when a call is
queued and no thread already started is idle, never more than ``size``; daemon threads
that a stop can leave behind; a call that raises ends its thread through the supervision
the pool was given."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError

import pytest

from outbox._dispatch.crew import Crew
from outbox._dispatch.workers import DaemonPool

WITHIN = 30.0  # generous: a loaded machine


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WITHIN
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.001)


class Blocked:
    """Calls that each report they started, then wait until released."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started: list[str] = []
        self.release = threading.Event()

    def __call__(self) -> None:
        with self.lock:
            self.started.append(threading.current_thread().name)
        self.release.wait(WITHIN)


def test_a_pool_handed_nothing_starts_nothing() -> None:
    pool = DaemonPool(64, "test-pool")
    pool.shutdown()
    assert pool.threads_started == 0


def test_calls_at_once_start_a_thread_each_up_to_size() -> None:
    calls = Blocked()
    pool = DaemonPool(3, "test-pool")
    try:
        for _ in range(5):
            pool.put(calls)
        wait_until(lambda: len(calls.started) == 3, "three calls at once")
        assert pool.threads_started == 3  # the other two wait for a thread
        assert sorted(calls.started) == ["test-pool-0", "test-pool-1", "test-pool-2"]
    finally:
        calls.release.set()
        pool.shutdown()
    assert len(calls.started) == 5 and pool.threads_started == 3


def test_an_idle_thread_takes_the_next_call_and_none_starts() -> None:
    pool = DaemonPool(64, "test-pool")
    names: list[str] = []
    try:
        for n in range(1, 21):
            pool.put(lambda: names.append(threading.current_thread().name))
            wait_until(lambda n=n: len(names) == n and pool.idle == 1,  # type: ignore[misc]
                       "the call to be done and its thread idle again")
    finally:
        pool.shutdown()
    assert pool.threads_started == 1 and names == ["test-pool-0"] * 20


def test_a_busy_thread_does_not_count_as_idle() -> None:
    calls = Blocked()
    pool = DaemonPool(64, "test-pool")
    try:
        done = threading.Event()
        pool.put(done.set)
        wait_until(lambda: done.is_set() and pool.idle == 1, "the first thread to be idle")
        pool.put(calls)  # takes the idle thread
        wait_until(lambda: len(calls.started) == 1, "the first call to start")
        pool.put(calls)  # none idle: a second thread
        wait_until(lambda: len(calls.started) == 2, "the second call to start")
        assert pool.threads_started == 2 and pool.idle == 0
    finally:
        calls.release.set()
        pool.shutdown()


def test_the_threads_are_daemons_and_end_at_shutdown() -> None:
    calls = Blocked()
    pool = DaemonPool(4, "test-pool")
    for _ in range(4):
        pool.put(calls)
    wait_until(lambda: len(calls.started) == 4, "four calls at once")
    ours = [t for t in threading.enumerate() if t.name.startswith("test-pool-")]
    assert len(ours) == 4 and all(t.daemon for t in ours)
    calls.release.set()
    pool.shutdown()
    assert not any(t.is_alive() for t in ours)
    with pytest.raises(RuntimeError, match="shut down"):
        pool.put(calls)


def test_a_join_with_a_deadline_leaves_a_call_that_never_returns_behind() -> None:
    calls = Blocked()
    pool = DaemonPool(4, "test-pool")
    pool.put(calls)
    pool.put(lambda: None)
    wait_until(lambda: len(calls.started) == 1, "the stuck call to start")
    pool.shutdown(wait=False)
    pool.join(time.monotonic() + 0.1)  # returns though one thread still performs
    stuck = [t for t in threading.enumerate() if t.name in calls.started]
    assert len(stuck) == 1 and stuck[0].is_alive()
    calls.release.set()
    pool.join()
    assert not stuck[0].is_alive()


def test_a_call_that_raises_ends_its_thread_through_the_supervision() -> None:
    deaths: list[BaseException] = []

    def supervise(serve: Callable[[], None]) -> Callable[[], None]:
        def supervised() -> None:
            try:
                serve()
            except BaseException as exc:
                deaths.append(exc)
        return supervised

    pool = DaemonPool(4, "test-pool", supervise=supervise)

    def dies() -> None:
        raise KeyboardInterrupt("a worker died")

    pool.put(dies)
    wait_until(lambda: bool(deaths), "the death to be reported")
    assert isinstance(deaths[0], KeyboardInterrupt) and pool.idle == 0
    done = threading.Event()
    pool.put(done.set)  # the dead thread is not idle: another one serves this
    assert done.wait(WITHIN) and pool.threads_started == 2
    pool.shutdown()  # the dead thread's end-of-work marker is left unread: no hang


def test_submit_is_an_executor_and_cancels_what_never_started() -> None:
    calls = Blocked()
    pool = DaemonPool(1, "test-pool")
    blocking = pool.submit(calls)
    wait_until(lambda: len(calls.started) == 1, "the first call to start")
    waiting = pool.submit(lambda: 1)
    pool.shutdown(wait=False, cancel_futures=True)
    calls.release.set()
    pool.join()
    assert blocking.result(WITHIN) is None and waiting.cancelled()
    with pytest.raises(CancelledError):
        waiting.result(0)

    pool = DaemonPool(2, "test-pool")
    def add(a: int, b: int = 0) -> int:
        return a + b

    assert pool.submit(add, 2, b=3).result(WITHIN) == 5
    failed = pool.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failed.result(WITHIN)
    pool.shutdown()


def test_a_fleets_crew_lends_its_threads_and_gets_them_back() -> None:
    """With a crew's ``start``: the pool's threads are crew members, named as the
    pool's; once the pool is shut down they serve the next pool, none started anew."""
    crew = Crew("test-crew")
    try:
        for _ in range(3):
            calls = Blocked()
            pool = DaemonPool(8, "test-pool", crew.start)
            pool.put(calls)
            pool.put(calls)
            wait_until(lambda: len(calls.started) == 2, "two calls at once")  # noqa: B023
            assert sorted(calls.started) == ["test-pool-0", "test-pool-1"]
            calls.release.set()
            pool.shutdown()
            assert pool.threads_started == 2
        assert crew.threads_started == 2
    finally:
        crew.close()


def test_a_call_that_never_returns_holds_up_no_call_behind_it() -> None:
    """Threads start one at a time, but the thread that takes a call with more waiting
    starts the next before it performs: the calls behind a stuck one are served."""
    stuck = Blocked()
    pool = DaemonPool(4, "test-pool")
    served = [threading.Event() for _ in range(3)]
    try:
        pool.put(stuck)
        for event in served:
            pool.put(event.set)
        assert all(event.wait(WITHIN) for event in served)
        assert len(stuck.started) == 1 and not stuck.release.is_set()
    finally:
        stuck.release.set()
        pool.shutdown()
    assert 2 <= pool.threads_started <= 4


def test_threads_started_after_shutdown_serve_what_was_queued_and_are_joined() -> None:
    """Calls queued before the shutdown while a thread was still starting: the thread
    that takes one of them with more waiting starts the next even after the shutdown
    (each with its end marker), and the join waits for every one of them."""
    let_start = threading.Event()
    stuck = Blocked()

    def start(target: Callable[[], object], name: str) -> threading.Thread:
        if name != "test-pool-0":
            let_start.wait(WITHIN)  # the second thread starts only when the test says
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        return thread

    pool = DaemonPool(3, "test-pool", start)
    pool.put(stuck)
    wait_until(lambda: len(stuck.started) == 1, "the first call to start")
    performed: list[str] = []
    putter = threading.Thread(target=pool.put, args=(lambda: performed.append("b"),))
    putter.start()  # starts the second thread, held in start()
    wait_until(lambda: pool.threads_started == 2, "the second thread to be starting")
    pool.put(lambda: performed.append("c"))  # one is starting: none started for these
    pool.put(lambda: performed.append("d"))
    assert pool.threads_started == 2
    pool.shutdown(wait=False)
    joiner = threading.Thread(target=pool.join)
    joiner.start()
    let_start.set()
    putter.join(WITHIN)
    wait_until(lambda: sorted(performed) == ["b", "c", "d"], "the calls queued to be served")
    assert pool.threads_started == 3  # the third started after the shutdown
    joiner.join(0.2)
    assert joiner.is_alive(), "the join returned with a call still performing"
    stuck.release.set()
    joiner.join(WITHIN)
    assert not joiner.is_alive()
    assert not [t for t in threading.enumerate() if t.name.startswith("test-pool-")]
