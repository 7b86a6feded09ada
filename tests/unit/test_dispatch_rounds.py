"""``Claimer.round`` and ``Recorder.record`` driven by a scripted executor, no database:
each test says which statements a step must ask for, in order, and what they answer.
Every test runs on both drivers of ``outbox._steps`` (``run`` and ``run_async``).

What the statements themselves do is tested against PostgreSQL elsewhere; here it is
the decisions around them: the rescue and retention timers, how much to claim (with and
without prefetch), idle detection, the split of a batch into complete and settle, a
retried batch, a refused one, and the heartbeat.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest

import outbox
from outbox import DispatchStats, SchemaError
from outbox._after import after_queries
from outbox._dispatch import claimer as claimer_module
from outbox._dispatch.budget import ClaimStep
from outbox._dispatch.claimer import (
    IDLE_RECHECK,
    PURGE_BATCHES,
    RESCUED_GRACE,
    RETENTION_BATCH,
    RETENTION_CATCH_UP,
    RETENTION_INTERVAL,
    SCHEMA_CHECK_INTERVAL,
    Claimer,
    retention_interval,
)
from outbox._dispatch.recorder import Recorder
from outbox._dispatch.rescuer import RescueHooks
from outbox._dispatch.settings import Settings
from outbox._dispatch.shared import HomeCall
from outbox._dispatch.state import Held, Outcome, Release, SharedState, Success
from outbox._steps import Rows, Statement, run, run_async, shaped
from outbox.migrate import latest_version
from outbox.observe import AttemptOutcome, DispatchObserver, PurgedTable


class Noop(outbox.Effect):
    name = "test.noop"

    def perform(self, job: outbox.Job) -> None:
        return None


class Events(DispatchObserver):
    """Every event, counted (the tests run on one thread)."""

    def __init__(self) -> None:
        self.finished: Counter[AttemptOutcome] = Counter()
        self.recorded_: Counter[AttemptOutcome] = Counter()
        self.fenced = 0
        self.purged_: Counter[PurgedTable] = Counter()
        self.lost_claims = 0

    def attempt_finished(self, effect: str, outcome: AttemptOutcome, duration: float) -> None:
        self.finished[outcome] += 1

    def recorded(self, outcome: AttemptOutcome, count: int) -> None:
        self.recorded_[outcome] += count

    def fence_rejected(self, effect: str) -> None:
        self.fenced += 1

    def purged(self, table: PurgedTable, count: int) -> None:
        self.purged_[table] += count

    def claims_lost(self, count: int) -> None:
        self.lost_claims += count


@dataclass
class Script:
    """The statements a step must ask for, in order, and each one's answer (rows, or an
    exception to raise)."""

    queries: Any
    expected: list[tuple[str, Rows | BaseException]] = field(default_factory=list)
    asked: list[tuple[str, Statement]] = field(default_factory=list)
    driver = "run"  # or "run_async": set for each test by the ``_driver`` fixture

    def then(self, name: str, answer: Rows | BaseException) -> Script:
        self.expected.append((name, answer))
        return self

    def claiming(self, answer: Rows | BaseException) -> Script:
        """A round's claim: the shared limit state of its effects first (no row: nothing
        limited or paused), then the claim."""
        return self.then("limit_states", []).then("claim", answer)

    def execute(self, statement: Statement | HomeCall | RescueHooks) -> Rows:
        assert isinstance(statement, Statement), "no limit here is shared: no home to call"
        assert self.expected, f"unexpected statement after {[n for n, _ in self.asked]}"
        name, answer = self.expected.pop(0)
        assert statement.query == _query(self.queries, name), (
            f"statement {len(self.asked) + 1}: expected {name}, got another")
        self.asked.append((name, statement))
        if isinstance(answer, BaseException):
            raise answer
        if answer and isinstance(answer[0], int):  # values: the step asked for them
            assert statement.scalar, f"{name}: ids answered to a statement not scalar"
            return answer
        # Rows scripted as tuples, shaped as the drivers shape a cursor's: named, or a
        # scalar statement's one column.
        return shaped(statement, COLUMNS.get(name, ()), answer)

    def drive(self, step: ClaimStep[Any]) -> Any:
        if self.driver == "run":
            result = run(step, self.execute)
        else:
            async def execute(statement: Statement | HomeCall | RescueHooks) -> Rows:
                return self.execute(statement)

            result = asyncio.run(run_async(step, execute))
        assert not self.expected, f"statements not asked for: {[n for n, _ in self.expected]}"
        return result

    def params(self, name: str) -> Any:
        [params] = [s.params for n, s in self.asked if n == name]
        return params


def _query(queries: Any, name: str) -> str:
    """A block of the core's query files, or of after.sql (fan-in's sweep)."""
    found: str = getattr(queries, name, None) or getattr(after_queries(queries.schema), name)
    return found


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture(autouse=True, params=["run", "run_async"])
def _driver(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Script, "driver", request.param)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(claimer_module, "time", clock)
    return clock


def settings(**options: Any) -> Settings:
    return Settings.build("", [Noop()], schema="outbox", **options)


def state(events: DispatchObserver | None = None, concurrency: int = 4) -> SharedState[Any]:
    return SharedState(DispatchStats(), events or DispatchObserver(), concurrency,
                       threading.Event)


CLAIMED = ("id", "effect", "key", "payload", "attempts", "claim_version", "ordering_key",
           "max_attempts", "first_attempted_at", "waited", "trace_context", "performed_result",
           "group_key", "priority", "scheduled_for", "after_failed")
# The columns of the statements answered by name, as their blocks name them.
COLUMNS = {"claim": CLAIMED, "limit_claim": (*CLAIMED, "budget_wait"),
           "rescue": ("id", "effect", "key", "attempts", "claim_version", "ordering_key",
                      "max_attempts", "first_attempted_at", "claimed_by", "group_key",
                      "priority", "scheduled_for", "cancelled", "now"),
           "heartbeat": ("id", "cancel"),
           "after_sweep": ("walked_child", "walked_parent", "woken"),
           "limit_states": ("effect", "gated", "pause_left", "pause_reason", "troubled"),
           "limit_throttled": ("effect", "pause_left", "pause_reason"),
           "limit_failed": ("effect", "pause_left", "pause_reason")}


def claimed_rows(*ids: int) -> Rows:
    """Rows as the claim returns them (the payload as JSON text)."""
    return [(i, "test.noop", f"k{i}", "{}", 1, 7, None, 25, datetime.now(UTC), 0.5, None,
             None, None, 0, None, None)
            for i in ids]


def held(*ids: int, attempt: int = 1) -> list[Held]:
    return [Held(outbox.Job(id=i, effect="test.noop", key=f"k{i}", payload={},
                            attempt=attempt, claim_version=7, ordering_key=None,
                            max_attempts=25, first_attempted_at=datetime.now(UTC)),
                 Noop(), False, started=True, duration=0.01) for i in ids]


# -- Claimer.round -------------------------------------------------------------------------


def test_the_first_round_rescues_purges_and_claims(clock: Clock) -> None:
    shared = state()
    claimer = Claimer(settings(prefetch=0), shared, until_idle=False)
    script = (Script(claimer.queries)
              .then("rescue", [(1, "test.noop", "k1", 1, 3, None, 25, datetime.now(UTC),
                                "w", None, 0, None, False, datetime.now(UTC))])
              .then("settle", settled(1))  # the rescue's decision, applied fenced
              .then("after_sweep", [(None, None, 0)])  # fan-in's repair, with the rescue
              .then("purge_done", [(RETENTION_BATCH,)])  # a full batch: go on
              .then("purge_done", [(3,)])
              .then("purge_ledger", [(0,)])
              .then("purge_inbox", [(2,)])
              .then("dispatcher_beat", [(1,)])  # the heartbeat: effects served
              .then("unhandled_due", [])  # and due jobs nobody serves
              .then("unanalyzed_tables", [])  # every queue table has statistics
              .then("vacuum_due", [])  # and none has dead rows to vacuum
              .claiming(claimed_rows(10, 11)))
    result = script.drive(claimer.round())
    assert [h.job.id for h in result.batch] == [10, 11] and result.wait == 0
    assert set(shared.held) == {10, 11}
    stats = shared.stats
    assert (stats.rescued, stats.purged, stats.claimed) == (1, RETENTION_BATCH + 5, 2)


def test_a_marked_claimer_falls_asleep_and_claims_once_more_before_it_waits(
        clock: Clock) -> None:
    claimer = Claimer(settings(prefetch=0, inbox_retention=None), state(concurrency=100),
                      until_idle=False)
    queries = claimer.queries
    (Script(queries).then("rescue", []).then("after_sweep", [(None, None, 0)])
     .then("purge_done", [(0,)]).then("purge_ledger", [(0,)]).then("dispatcher_beat", [(1,)])
     .then("unhandled_due", []).then("unanalyzed_tables", []).then("vacuum_due", [])
     .claiming(claimed_rows(10))).drive(claimer.round())  # woken for one: no mark yet
    # Busy a second round in a row: enqueues of its effects need not notify it.
    Script(queries).claiming(claimed_rows(11)).then("awake_mark", [(1,)]).drive(
        claimer.round())
    # Claiming again soon after: the mark still holds, nothing is written.
    result = Script(queries).claiming(claimed_rows(12)).drive(claimer.round())
    assert [h.job.id for h in result.batch] == [12] and result.wait == 0
    # Nothing found: the mark goes (behind the fence), and the claimer claims once more.
    result = Script(queries).claiming([]).then("fall_asleep", [(True,)]).drive(claimer.round())
    assert (result.batch, result.wait) == ([], 0)
    # Nothing still: it waits, and writes nothing more.
    result = Script(queries).claiming([]).drive(claimer.round())
    assert result.batch == [] and result.wait > 0
    # Woken for one job, then nothing: no mark, so no fence before it sleeps.
    Script(queries).claiming(claimed_rows(13)).drive(claimer.round())
    result = Script(queries).claiming([]).drive(claimer.round())
    assert result.batch == [] and result.wait > 0


def test_run_until_idle_never_marks_itself_awake(clock: Clock) -> None:
    claimer = Claimer(settings(prefetch=0, inbox_retention=None), state(), until_idle=True)
    assert not claimer.awake.enabled
    (Script(claimer.queries).then("rescue", []).then("after_sweep", [(None, None, 0)])
     .then("purge_done", [(0,)]).then("purge_ledger", [(0,)]).then("dispatcher_beat", [(1,)])
     .then("unhandled_due", []).then("unanalyzed_tables", [])
     .claiming(claimed_rows(10))).drive(claimer.round())


def test_rescue_and_retention_wait_for_their_timers(clock: Clock) -> None:
    claimer = Claimer(settings(prefetch=0, rescue_interval=5.0, inbox_retention=None),
                      state(), until_idle=False)
    queries = claimer.queries
    (Script(queries).then("rescue", []).then("after_sweep", [(None, None, 0)])
     .then("purge_done", [(0,)])
     .then("purge_ledger", [(0,)]).then("dispatcher_beat", [(1,)])
     .then("unhandled_due", []).then("unanalyzed_tables", []).then("vacuum_due", [])
     .claiming([])).drive(claimer.round())
    clock.now += 4.9  # neither timer due: only the claim
    Script(queries).claiming([]).drive(claimer.round())
    clock.now += 0.2  # the rescue timer (5 s) is due, and the look for dead rows; not retention
    (Script(queries).then("rescue", []).then("after_sweep", [(None, None, 0)])
     .then("vacuum_due", []).claiming([]).drive(claimer.round()))
    clock.now += RETENTION_INTERVAL  # the heartbeat (every 15 s) is due again too
    assert RETENTION_INTERVAL > SCHEMA_CHECK_INTERVAL  # and the look at the schema's version
    (Script(queries).then("schema_version", [(latest_version(),)])
     .then("rescue", []).then("after_sweep", [(None, None, 0)]).then("purge_done", [(0,)])
     .then("purge_ledger", [(0,)]).then("dispatcher_beat", [(1,)])
     .then("unhandled_due", []).then("vacuum_due", []).claiming([])).drive(claimer.round())


def test_retention_that_is_behind_comes_back_soon_until_it_has_caught_up(
        clock: Clock) -> None:
    claimer = Claimer(settings(prefetch=0, inbox_retention=None), state(), until_idle=False)
    claimer.rescue_timer.next_at = claimer.schema_timer.next_at = float("inf")
    claimer.presence.timer.next_at = claimer.vacuum.timer.next_at = float("inf")
    claimer.statistics.done = True
    queries = claimer.queries
    behind = Script(queries)
    for _ in range(PURGE_BATCHES):  # a round's worth of full batches: rows are left
        behind.then("purge_done", [(RETENTION_BATCH,)])
    behind.then("purge_ledger", [(0,)]).claiming([]).drive(claimer.round())
    clock.now += RETENTION_CATCH_UP / 2
    Script(queries).claiming([]).drive(claimer.round())
    clock.now += RETENTION_CATCH_UP / 2  # due again long before RETENTION_INTERVAL
    (Script(queries).then("purge_done", [(7,)]).then("purge_ledger", [(0,)])
     .claiming([]).drive(claimer.round()))
    clock.now += RETENTION_CATCH_UP  # caught up: back to the interval
    Script(queries).claiming([]).drive(claimer.round())
    assert claimer.retention_timer.next_at > clock.now + RETENTION_INTERVAL / 2


def test_a_schema_migrated_past_this_code_stops_the_claimer(clock: Clock) -> None:
    claimer = Claimer(settings(prefetch=0), state(), until_idle=False)
    first_round_done(claimer)
    claimer.schema_timer.next_at = 0.0
    with pytest.raises(SchemaError, match=r"migrated to version \d+, newer than this code"):
        Script(claimer.queries).then(
            "schema_version", [(latest_version() + 1,)]).drive(claimer.round())


def first_round_done(claimer: Claimer) -> None:
    """Past the first round's rescue and retention, so later rounds only claim."""
    claimer.rescue_timer.next_at = claimer.retention_timer.next_at = float("inf")
    claimer.schema_timer.next_at = float("inf")
    claimer.statistics.done = True
    claimer.presence.timer.next_at = claimer.vacuum.timer.next_at = float("inf")


@pytest.mark.parametrize(("held_now", "limit"), [(0, 6), (3, 3), (5, 1), (6, None)])
def test_capacity_with_prefetch_is_concurrency_plus_prefetch(
        clock: Clock, held_now: int, limit: int | None) -> None:
    shared = state(concurrency=4)
    claimer = Claimer(settings(concurrency=4, prefetch=2), shared, until_idle=False)
    first_round_done(claimer)
    shared.hold(held(*range(1, held_now + 1)))
    script = Script(claimer.queries)
    if limit is not None:
        script.claiming([])
    result = script.drive(claimer.round())
    if limit is None:  # full: no claim at all, wait for room
        assert result.batch == [] and result.wait == claimer.settings.poll_interval
    else:
        assert script.params("claim")["limit"] == limit


@pytest.mark.parametrize(("mean", "held_now", "limit"), [
    (None, 0, 8),       # nothing measured yet: twice the concurrency
    (None, 2, 6),
    (None, 7, None),    # one free of eight: under a quarter of a batch, wait
    (0.01, 0, 404),     # fast effects: a second of work ahead (4 / 0.01 = 400)
    (10.0, 0, 5),       # slow effects: at least one waiting job
])
def test_capacity_without_prefetch_follows_the_measured_speed(
        clock: Clock, mean: float | None, held_now: int, limit: int | None) -> None:
    shared = state(concurrency=4)
    shared.mean_perform_seconds = mean
    claimer = Claimer(settings(concurrency=4), shared, until_idle=False)
    first_round_done(claimer)
    shared.hold(held(*range(1, held_now + 1)))
    script = Script(claimer.queries)
    if limit is not None:
        script.claiming([])
    script.drive(claimer.round())
    if limit is not None:
        assert script.params("claim")["limit"] == limit


def test_run_until_idle_stops_when_nothing_is_due_anywhere(clock: Clock) -> None:
    claimer = Claimer(settings(prefetch=0), state(), until_idle=True)
    first_round_done(claimer)
    result = (Script(claimer.queries).claiming([]).then("has_due_work", [(False,)])
              .then("after_sweep", [(None, None, 0)])  # no child its parents' settlement missed
              .drive(claimer.round()))
    assert result.idle and result.batch == []


def test_run_until_idle_rescues_and_looks_again_while_others_hold_work(clock: Clock) -> None:
    claimer = Claimer(settings(prefetch=0), state(), until_idle=True)
    first_round_done(claimer)
    result = (Script(claimer.queries).claiming([]).then("has_due_work", [(True,)])
              .then("rescue", []).drive(claimer.round()))
    assert not result.idle and result.wait == IDLE_RECHECK


def _expired_row(job_id: int, attempts: int = 1) -> tuple[Any, ...]:
    """A row of the rescue's read: a claim of test.noop whose lease expired."""
    return (job_id, "test.noop", f"k{job_id}", attempts, 3, None, 25, datetime.now(UTC), "w",
            None, 0, None, False, datetime.now(UTC))


def test_run_until_idle_waits_for_the_jobs_it_rescued_until_it_claims_them(
        clock: Clock) -> None:
    """A job rescued to pending retries after its backoff: run_until_idle waits for it
    (it was running, which it waits for), a poll interval at a time, until it claims it,
    or a grace past its due time runs out (another dispatcher took it)."""
    claimer = Claimer(settings(prefetch=0, poll_interval=0.5,
                               backoff=outbox.Backoff(base=3.0, cap=3.0)),
                      state(), until_idle=True)
    first_round_done(claimer)
    (Script(claimer.queries).claiming([]).then("has_due_work", [(True,)])
     .then("rescue", [_expired_row(1), _expired_row(2)]).then("settle", settled(1, 2))
     .drive(claimer.round()))
    due = dict(claimer.rescued_due)
    assert set(due) == {1, 2} and all(clock.now <= d <= clock.now + 3.0 for d in due.values())
    waiting = (Script(claimer.queries).claiming([]).then("has_due_work", [(False,)])
               .drive(claimer.round()))
    assert not waiting.idle and IDLE_RECHECK <= waiting.wait <= 0.5  # not idle: waits
    clock.now = max(due.values()) + 0.1
    claimed = Script(claimer.queries).claiming(claimed_rows(1)).drive(claimer.round())
    assert [h.job.id for h in claimed.batch] == [1] and set(claimer.rescued_due) == {2}
    claimer.state.held.clear()
    clock.now = due[2] + RESCUED_GRACE + 0.1  # job 2 never came back here: given up
    result = (Script(claimer.queries).claiming([]).then("has_due_work", [(False,)])
              .then("after_sweep", [(None, None, 0)]).drive(claimer.round()))
    assert result.idle and claimer.rescued_due == {}


def test_jobs_in_hand_are_waited_for_without_asking_the_database(clock: Clock) -> None:
    shared = state()
    claimer = Claimer(settings(prefetch=0), shared, until_idle=True)
    first_round_done(claimer)
    shared.hold(held(1))
    result = Script(claimer.queries).claiming([]).drive(claimer.round())
    assert not result.idle and result.wait == claimer.settings.poll_interval


def test_run_polls_with_jitter_when_nothing_was_claimed(clock: Clock) -> None:
    claimer = Claimer(settings(prefetch=0, poll_interval=2.0), state(), until_idle=False)
    first_round_done(claimer)
    waits = {Script(claimer.queries).claiming([]).drive(claimer.round()).wait
             for _ in range(20)}
    assert all(1.0 <= w <= 2.0 for w in waits) and len(waits) > 1


# -- Recorder.record -----------------------------------------------------------------------


def written(*ids: int) -> Rows:
    """What a fenced statement answers (``scalar``): the ids of the jobs it changed."""
    return list(ids)


def settled(*ids: int, cancelled: Sequence[int] = ()) -> Rows:
    """What ``settle`` answers: (id, cancelled) of each job it settled; ``cancelled``:
    those whose claim it found cancelled by an operator (it wrote their other decision)."""
    return [(job_id, job_id in cancelled) for job_id in ids]


def landed(*ids: int) -> Rows:
    """What ``recorded_claims`` answers (``scalar``): the ids whose claim is recorded."""
    return list(ids)


def recorder(events: Events) -> tuple[Recorder, SharedState[Any]]:
    shared = state(events)
    return Recorder(settings(), shared), shared


def outcomes(jobs: Sequence[Held], *what: Outcome) -> list[tuple[Held, Outcome]]:
    return list(zip(jobs, what, strict=True))


def test_a_batch_splits_into_one_complete_and_one_settle() -> None:
    events = Events()
    rec, shared = recorder(events)
    jobs = held(1, 2, 3, 4, 5)
    shared.hold(jobs)
    batch = outcomes(jobs, Success('{"a":1}'), Success("null"), outbox.Retry(after=30),
                     outbox.Permanent("no"), Release())
    script = (Script(rec.queries).then("complete", written(1, 2))
              .then("settle", settled(3, 4, 5)))
    script.drive(rec.record(batch))
    assert json.loads(script.params("complete")["claims"]) == [
        {"id": 1, "version": 7, "result": {"a": 1}}, {"id": 2, "version": 7, "result": None}]
    claims = {c["id"]: c for c in json.loads(script.params("settle")["claims"])}
    assert set(claims) == {3, 4, 5}
    assert (claims[3]["status"], claims[3]["delay"]) == ("pending", 30)
    assert claims[4]["status"] == "failed" and claims[4]["error"]
    assert (claims[5]["status"], claims[5]["refund"]) == ("pending", True)
    assert batch == [] and shared.held == {}
    assert events.recorded_ == Counter(done=2, retry=1, failed=1, released=1)
    assert shared.stats.done == 2 and shared.stats.released == 1


def test_a_settlement_settle_found_cancelled_is_reported_as_it_wrote_it() -> None:
    # settle answers that it found claims 3 (a retry) and 5 (a release) cancelled by an
    # operator: it wrote their cancelled_* decisions (failed), and they are reported so;
    # 4 (failed either way) stays failed.
    events = Events()
    rec, shared = recorder(events)
    jobs = held(3, 4, 5)
    shared.hold(jobs)
    spans = {h.job.id: Span() for h in jobs}
    for h in jobs:
        h.span = spans[h.job.id]
    batch = outcomes(jobs, outbox.Retry(after=30), outbox.Permanent("no"), Release())
    script = Script(rec.queries).then("settle", settled(3, 4, 5, cancelled=(3, 4, 5)))
    script.drive(rec.record(batch))
    claims = {c["id"]: c for c in json.loads(script.params("settle")["claims"])}
    assert [claims[i]["cancelled_status"] for i in (3, 4, 5)] == ["failed"] * 3
    assert events.finished == events.recorded_ == Counter(failed=3)
    assert (shared.stats.failed, shared.stats.retried, shared.stats.released) == (3, 0, 0)
    assert {i: (s.attributes["outbox.outcome"], s.ended) for i, s in spans.items()} == {
        i: ("failed", True) for i in (3, 4, 5)}


class Span:
    """What the tracing of a settled attempt calls on its span, recorded."""

    def __init__(self) -> None:
        self.attributes: dict[str, Any] = {}
        self.ended = False

    def add_event(self, name: str, attributes: dict[str, Any]) -> None:
        pass

    def set_attributes(self, attributes: dict[str, Any]) -> None:
        self.attributes.update(attributes)

    def set_status(self, status: Any) -> None:
        pass

    def end(self) -> None:
        self.ended = True


def test_only_failures_need_no_complete() -> None:
    rec, shared = recorder(Events())
    jobs = held(1)
    shared.hold(jobs)
    Script(rec.queries).then("settle", settled(1)).drive(
        rec.record(outcomes(jobs, RuntimeError("boom"))))
    assert shared.stats.retried == 1


def test_fenced_writes_that_change_nothing_are_lost_claims() -> None:
    events = Events()
    rec, shared = recorder(events)
    jobs = held(1, 2)
    shared.hold(jobs)
    (Script(rec.queries).then("complete", written()).then("settle", settled())
     .drive(rec.record(outcomes(jobs, Success("null"), outbox.Retry()))))
    assert events.finished == Counter(lost=2) and events.fenced == 2
    assert shared.stats.stale_completions == 2 and shared.held == {}


def test_a_retried_batch_asks_the_ledger_about_completions_missing_from_the_reply() -> None:
    events = Events()
    rec, shared = recorder(events)
    rec.retrying = True  # the first send's reply was lost with the connection
    jobs = held(1, 2, 3)
    shared.hold(jobs)
    script = (Script(rec.queries).then("complete", written(1))
              .then("recorded_claims", landed(2)))  # 2 landed the first time; 3 was lost
    script.drive(rec.record(outcomes(jobs, *(Success("null") for _ in jobs))))
    assert [c["id"] for c in json.loads(script.params("recorded_claims")["claims"])] == [2, 3]
    assert events.recorded_ == Counter(done=2, lost=1)


def test_a_batch_sent_again_after_a_lost_connection_counts_what_landed_the_first_time(
        ) -> None:
    events = Events()
    rec, shared = recorder(events)
    jobs = held(1, 2, 3, 4)
    shared.hold(jobs)
    pending = outcomes(jobs, Success("null"), Success("null"), Success("null"),
                       outbox.Permanent("declined"))
    gone = psycopg.OperationalError("server closed the connection")
    with pytest.raises(psycopg.OperationalError):
        Script(rec.queries).then("complete", gone).drive(rec.flush(pending))
    rec.failed(gone, lost=True, pending=pending)  # what recording does, then waits
    assert rec.retrying and len(pending) == 4 and events.recorded_ == Counter()
    # Sent again: 1 and 2 landed the first time (the ledger knows, though the reply said
    # only 3), and the settle, never sent before, goes now.
    script = (Script(rec.queries).then("complete", written(3))
              .then("recorded_claims", landed(1, 2))
              .then("settle", settled(4)))
    script.drive(rec.flush(pending))
    assert [c["id"] for c in json.loads(script.params("recorded_claims")["claims"])] == [1, 2]
    assert pending == [] and shared.held == {}
    assert events.recorded_ == Counter(done=3, failed=1)


def test_a_batch_that_is_not_retried_does_not_ask_the_ledger() -> None:
    events = Events()
    rec, shared = recorder(events)
    jobs = held(1, 2)
    shared.hold(jobs)
    Script(rec.queries).then("complete", written(1)).drive(
        rec.record(outcomes(jobs, Success("null"), Success("null"))))
    assert events.recorded_ == Counter(done=1, lost=1)


def test_a_refused_batch_is_recorded_one_by_one_and_a_refused_row_dropped() -> None:
    events = Events()
    rec, shared = recorder(events)
    jobs = held(1, 2)
    shared.hold(jobs)
    pending = outcomes(jobs, Success("null"), Success("null"))
    refused = psycopg.errors.CheckViolation("refused")
    (Script(rec.queries).then("complete", refused)   # the batch
     .then("complete", written(1))                    # job 1 alone
     .then("complete", psycopg.errors.CheckViolation("refused"))  # job 2 alone
     .drive(rec.flush(pending)))
    assert pending == [] and shared.held == {}
    # Job 2's outcome could not be written: still an attempt the observer hears of.
    assert events.finished == Counter(done=1, lost=1)


def test_a_lost_connection_keeps_the_batch_for_the_next_try() -> None:
    rec, shared = recorder(Events())
    jobs = held(1)
    shared.hold(jobs)
    pending = outcomes(jobs, Success("null"))
    with pytest.raises(psycopg.OperationalError):
        Script(rec.queries).then("complete", psycopg.OperationalError("gone")).drive(
            rec.flush(pending))
    assert len(pending) == 1 and set(shared.held) == {1}


@pytest.mark.parametrize("error", [RuntimeError("a bug"),
                                   psycopg.errors.InsufficientPrivilege("denied")])
def test_an_error_no_retry_helps_drops_the_batch_and_ends_the_recorder(
        error: BaseException) -> None:
    events = Events()
    rec, shared = recorder(events)
    jobs = held(1, 2)
    shared.hold(jobs)
    pending = outcomes(jobs, Success("null"), outbox.Retry())
    with pytest.raises((RuntimeError, outbox.ConfigurationError)):
        # The Retry is a transient failure: counted toward its effect's breaker first.
        (Script(rec.queries).then("limit_ensure", [(1,)]).then("limit_failed", [])
         .then("complete", error).drive(rec.flush(pending)))
    assert pending == [] and shared.held == {}
    assert events.finished == Counter(lost=2)


def test_a_refused_write_of_the_limit_state_still_records_the_outcomes() -> None:
    events = Events()
    rec, shared = recorder(events)
    jobs = held(1)
    shared.hold(jobs)
    pending = outcomes(jobs, outbox.Retry())  # transient: counted toward the breaker
    (Script(rec.queries).then("limit_ensure", psycopg.errors.CheckViolation("refused"))
     .then("limit_failed", psycopg.errors.CheckViolation("refused"))
     .then("settle", settled(1)).drive(rec.flush(pending)))
    assert pending == [] and events.recorded_ == Counter(retry=1)


def test_the_heartbeat_marks_the_claims_it_did_not_extend() -> None:
    events = Events()
    rec, shared = recorder(events)
    shared.hold(held(1, 2, 3))
    # (id, cancel) of each lease extended: job 3's claim was cancelled by an operator.
    script = Script(rec.queries).then("heartbeat", [(1, False), (3, True)])
    script.drive(rec.heartbeat())
    assert [c["id"] for c in json.loads(script.params("heartbeat")["claims"])] == [1, 2, 3]
    assert [h.job.id for h in shared.held.values() if h.lost] == [2]
    assert events.lost_claims == 1 and events.fenced == 1
    reasons = {h.job.id: getattr(h.job.cancelled, "reason", None) for h in shared.held.values()}
    assert reasons == {1: None, 2: "lost", 3: "operator"}


def test_no_heartbeat_without_claims() -> None:
    rec, _ = recorder(Events())
    Script(rec.queries).drive(rec.heartbeat())


@pytest.fixture(autouse=True)
def _no_threads() -> Iterator[None]:
    before = threading.active_count()
    yield
    assert threading.active_count() == before  # the steps ran on this thread alone


class _Fatal(BaseException):
    """What an observer raises past ``guarded``: it ends the part that called it."""


class _ObserverThatKills(DispatchObserver):
    def attempt_finished(self, effect: str, outcome: AttemptOutcome, duration: float) -> None:
        raise _Fatal("observer crashed")


def test_outcomes_dropped_after_a_part_died_of_its_observer_do_not_hide_that_death() -> None:
    # The recorder died of the observer (a BaseException); the caller's thread then
    # drops what it will never write. Calling the observer again must not raise on the
    # caller's thread, or the run would end with the observer's error instead of
    # DispatcherFailed; every job is still given up to its lease.
    shared = state(_ObserverThatKills())
    jobs = held(1, 2, 3)
    shared.hold(jobs)
    for job in jobs:
        shared.finish(job, Success("null"))
    shared.fail("recorder", _Fatal("observer crashed"))
    shared.drop_unrecorded()
    assert not shared.held and not shared.outcomes


def test_outcomes_dropped_with_no_part_dead_let_an_observer_interrupt_through() -> None:
    shared = state(_ObserverThatKills())
    jobs = held(1)
    shared.hold(jobs)
    shared.finish(jobs[0], Success("null"))
    with pytest.raises(_Fatal):
        shared.drop_unrecorded()


@pytest.mark.parametrize(("options", "interval"), [
    ({}, RETENTION_INTERVAL),  # 7 days: a round a minute
    ({"retention": 60, "ledger_retention": None}, 10.0),  # rows outlive 60 s by 10 s at most
    ({"retention": None, "ledger_retention": None, "inbox_retention": 120}, 20.0),
    ({"retention": 3, "ledger_retention": None}, RETENTION_CATCH_UP),
    ({"retention": 0, "ledger_retention": None, "inbox_retention": None}, RETENTION_INTERVAL),
    ({"retention": None, "ledger_retention": None, "inbox_retention": None},
     RETENTION_INTERVAL),
])
def test_retention_comes_often_enough_for_the_shortest_retention(
        options: dict[str, Any], interval: float) -> None:
    given = settings(**options)
    assert retention_interval(given) == interval
    claimer = Claimer(given, SharedState(DispatchStats(), DispatchObserver(), 4,
                                         threading.Event), until_idle=False)
    assert claimer.retention_timer.interval == interval
