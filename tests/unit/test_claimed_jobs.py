"""The drain's hot Python, no database: the claimed rows made into jobs (``_helds``,
``_new_job``), how a batch of fast jobs is handed to the worker threads, and the
cancellation watcher's end.

Each fast path replaces a plainer one; these tests hold it to what the plain one gave:
a ``Job`` equal field for field to ``Job(...)``, each column of the claim in its field,
every job of a batch handed over once, a watcher that ends when the workers do.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from datetime import UTC, datetime
from typing import Any

import pytest

import outbox
from outbox import DispatchStats
from outbox._cancelling import CancelSignal
from outbox._dispatch import cancellation
from outbox._dispatch.claimer import CLAIMED, Claimer, _new_job
from outbox._dispatch.counting import EFFECT_COLUMN, WAITED_COLUMN, Waits
from outbox._dispatch.runtime import drive
from outbox._dispatch.settings import Settings
from outbox._dispatch.state import Held, SharedState
from outbox._dispatch.workers import RETURNED_NONE, Performer, ThreadWorkers
from outbox._steps import ColumnsChanged, Statement, shaped
from outbox.observe import DispatchObserver


class Noop(outbox.Effect):
    name = "test.noop"

    def perform(self, job: outbox.Job) -> None:
        return None


class Echo(outbox.Effect):
    name = "test.echo"

    def perform(self, job: outbox.Job) -> dict[str, Any]:
        return {"id": job.id}


def settings(**options: Any) -> Settings:
    return Settings.build("", [Noop(), Echo()], schema="outbox", **options)


def state(concurrency: int = 4) -> SharedState[Any]:
    return SharedState(DispatchStats(), DispatchObserver(), concurrency, threading.Event)


FIRST_AT = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)
SLOT = datetime(2026, 12, 5, 11, 0, tzinfo=UTC)


def claimed_row(**changes: Any) -> dict[str, Any]:
    """A claimed row by column name, every column a value of its own."""
    row = {"id": 41, "effect": "test.echo", "key": "k-41", "payload": '{"n":1,"s":"x"}',
           "attempts": 3, "claim_version": 9, "ordering_key": "order-7", "max_attempts": 12,
           "first_attempted_at": FIRST_AT, "waited": 0.25, "trace_context": None,
           "performed_result": '{"kept":true}', "group_key": "tenant-a", "priority": 5,
           "scheduled_for": SLOT, "after_failed": "run"}
    assert set(row) == set(CLAIMED)
    return {**row, **changes}


def as_tuple(row: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(row[name] for name in CLAIMED)


def test_a_job_made_from_its_slots_equals_the_dataclass_made_one() -> None:
    values = (7, "test.echo", "k-7", {"a": [1, 2]}, 2, 5, "ok", 9, FIRST_AT, None, "g", -3,
              SLOT, {"parent": {"r": 1}}, CancelSignal())
    made, plain = _new_job(values), outbox.Job(*values)
    for field in dataclasses.fields(outbox.Job):
        assert getattr(made, field.name) is getattr(plain, field.name), field.name
    assert made == plain and repr(made) == repr(plain)
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.key = "other"  # type: ignore[misc]


def test_a_job_is_refused_a_field_short() -> None:
    with pytest.raises(ValueError, match="values to unpack"):
        _new_job((1, "test.echo", "k"))


@pytest.mark.parametrize("traced", [False, True])
def test_each_claimed_column_lands_in_its_field(
        monkeypatch: pytest.MonkeyPatch, traced: bool) -> None:
    monkeypatch.setattr(outbox.tracing, "enabled", lambda: traced)
    own = settings()
    claimer = Claimer(own, state(), until_idle=True)
    row = claimed_row(trace_context={"traceparent": "00-x"})
    parents = {41: {"parent-key": {"done": True}}}
    [held] = claimer._helds([as_tuple(row)], parents)
    job = held.job
    assert (job.id, job.effect, job.key, job.payload) == (41, "test.echo", "k-41",
                                                          {"n": 1, "s": "x"})
    assert (job.attempt, job.claim_version, job.ordering_key, job.max_attempts) == (
        3, 9, "order-7", 12)
    assert (job.first_attempted_at, job.group, job.priority, job.scheduled_for) == (
        FIRST_AT, "tenant-a", 5, SLOT)
    assert job.after_results == {"parent-key": {"done": True}} and job.model is None
    assert isinstance(job.cancelled, CancelSignal) and not job.cancelled.is_set()
    assert held.effect is own.effects["test.echo"] and held.is_async is False
    assert (held.started, held.lost, held.duration, held.span) == (False, False, 0.0, None)
    assert held.kept_result == '{"kept":true}' and held.traced is traced
    assert held.trace_context == ({"traceparent": "00-x"} if traced else None)


def test_jobs_of_one_claim_get_signals_and_results_of_their_own() -> None:
    claimer = Claimer(settings(), state(), until_idle=True)
    rows = [as_tuple(claimed_row(id=i, key=f"k-{i}", effect="test.noop")) for i in (1, 2)]
    first, second = (h.job for h in claimer._helds(rows, {}))
    assert first.cancelled is not second.cancelled
    assert first.after_results == {} and first.after_results is not second.after_results


def test_a_limited_claims_wider_named_rows_read_the_same() -> None:
    # limit_claim answers c.* (the columns of CLAIMED) and then its own.
    row = claimed_row()
    wide = shaped(Statement("", {}, named=True),
                  (*CLAIMED, "budget_wait", "walked_to", "groups_spent"),
                  [(*as_tuple(row), 0.5, "tenant-a", None)])
    claimer = Claimer(settings(), state(), until_idle=True)
    [plain] = claimer._helds([as_tuple(row)], {})
    [named] = claimer._helds(wide, {})
    assert named.job == plain.job and named.kept_result == plain.kept_result


def test_the_claims_waits_read_effect_and_wait_by_their_columns() -> None:
    assert (CLAIMED[EFFECT_COLUMN], CLAIMED[WAITED_COLUMN]) == ("effect", "waited")
    rows = [as_tuple(claimed_row(id=1, waited=1.5)), as_tuple(claimed_row(id=2, waited=0))]
    waits = Waits(rows)
    assert list(waits) == [("test.echo", 1.5), ("test.echo", 0.0)]
    assert waits[1] == ("test.echo", 0.0) and waits[:1] == [("test.echo", 1.5)]


def test_columns_other_than_the_reader_names_are_refused() -> None:
    statement = Statement("SELECT 1", {}, columns=("id", "key"))
    assert shaped(statement, ["id", "key"], [[1, "k"]]) == [(1, "k")]
    with pytest.raises(ColumnsChanged, match=r"\['key', 'id'\].*\['id', 'key'\]"):
        shaped(statement, ["key", "id"], [["k", 1]])


def _helds(count: int) -> list[Held]:
    return [Held(outbox.Job(i, "test.noop", f"k{i}", {}, 1, 1), Noop(), False)
            for i in range(count)]


@pytest.mark.parametrize(("mean", "jobs", "sizes"), [
    (None, 100, [1] * 100),  # nothing measured yet: one job a unit
    (0.5, 100, [1] * 100),  # slow: one job a unit, every worker busy
    (1e-6, 4, [1] * 4),  # no more jobs than workers
    (1e-6, 2000, [256] * 7 + [208]),  # no-ops: runs of MAX_RUN
    (1e-5, 2000, [200] * 10),  # RUN_SECONDS of work a run
    (5e-4, 2000, [32] * 62 + [16]),  # spread over the 64 workers
])
def test_fast_jobs_go_to_the_threads_in_runs_of_some_milliseconds(
        mean: float | None, jobs: int, sizes: list[int]) -> None:
    shared = state(concurrency=64)
    shared.mean_perform_seconds = mean
    batch = _helds(jobs)
    chunks = ThreadWorkers(settings(concurrency=64), shared)._chunks(batch)
    assert [len(chunk) for chunk in chunks] == sizes
    assert [h for chunk in chunks for h in chunk] == batch  # each once, in order


def test_a_perform_that_returned_none_shares_one_outcome() -> None:
    shared = state()
    performer = Performer(shared)
    [noop] = _helds(1)
    echo = Held(outbox.Job(5, "test.echo", "k5", {}, 1, 1), Echo(), False)
    assert performer.call_sync(noop) is RETURNED_NONE
    assert RETURNED_NONE.result_json == "null"
    outcome = performer.call_sync(echo)
    assert outcome is not RETURNED_NONE and getattr(outcome, "result_json", None) == '{"id":5}'


def test_the_cancellation_watcher_ends_with_the_workers_not_at_its_next_sweep(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cancellation, "SWEEP", 3600.0)  # a sleeping watcher would stay
    shared = state()
    watcher = threading.Thread(target=drive, args=(cancellation.watching(shared, 60.0),),
                               daemon=True)
    watcher.start()
    shared.workers_ended()
    watcher.join(60)
    assert not watcher.is_alive()
    shared.reset()  # the next run's watcher sweeps again until its workers end
    assert not shared.workers_ended_signal.is_set()



class CountedSignal(CancelSignal):
    """A job's signal that counts the watcher's looks at its lease."""

    __slots__ = ("looks",)

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.looks = 0

    def check(self, now: float) -> bool:
        self.looks += 1
        return super().check(now)


def test_the_watcher_looks_at_no_lease_before_one_can_have_expired() -> None:
    shared = state()
    signal = CountedSignal(shared.watch, 60.0, None)
    held = Held(outbox.Job(1, "test.noop", "k1", {}, 1, 1, cancelled=signal), Noop(), False,
                started=True)
    shared.hold([held])
    now = time.monotonic()
    cancellation.sweep(shared, 60.0, now)  # no heartbeat yet, and no lease 60 s old
    assert signal.looks == 0
    cancellation.sweep(shared, 60.0, now + 61.0)  # no heartbeat for a lease: each looked at
    assert signal.looks == 1 and signal.reason == "lease"
