"""Limits per group (``Limit(..., per_group=True)``) against real PostgreSQL: a
concurrency and a rate that apply to each group on its own, and a throttle that pauses
only the refused group."""

from __future__ import annotations

import threading
import time
from collections import Counter
from itertools import pairwise
from typing import Any

import psycopg
import pytest
from psycopg import sql

import outbox
from outbox import Dispatcher, Effect, Job, Limit, NewJob
from outbox.limits import parse_limit


def enqueue(dsn: str, schema: str, items: list[NewJob]) -> None:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue_many(items)


def query(dsn: str, schema: str, text: str, params: Any = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(sql.SQL(text).format(schema=sql.Identifier(schema)),
                            params).fetchall()


class InFlight(Effect):
    """Holds each job until ``release`` is set or ``hold`` seconds pass, counting how
    many of each group (and in all) are in flight at once."""

    name = "test.in_flight"

    def __init__(self, hold: float) -> None:
        self.hold = hold
        self.lock = threading.Lock()
        self.now: Counter[str] = Counter()
        self.most: Counter[str] = Counter()
        self.total = 0
        self.most_total = 0
        self.done = 0

    def perform(self, job: Job) -> None:
        group = job.group or ""
        with self.lock:
            self.now[group] += 1
            self.total += 1
            self.most[group] = max(self.most[group], self.now[group])
            self.most_total = max(self.most_total, self.total)
        try:
            time.sleep(self.hold)  # the provider call's duration, not a synchronisation
        finally:
            with self.lock:
                self.now[group] -= 1
                self.total -= 1
                self.done += 1


def test_a_concurrency_per_group_caps_each_group_and_lets_the_groups_run_together(
    dsn: str, schema: str,
) -> None:
    # The figure: 4 groups x 25 jobs of 50 ms, dispatcher concurrency 16,
    # Limit(concurrency=2, per_group=True).
    enqueue(dsn, schema, [NewJob(InFlight.name, f"{g}-{i}", {}, group=f"tenant-{g}")
                          for i in range(25) for g in range(4)])
    effect = InFlight(hold=0.05)
    stats = Dispatcher(dsn, [effect], schema=schema, concurrency=16,
                       limits={InFlight.name: Limit(concurrency=2, per_group=True)},
                       ).run_until_idle(timeout=120)
    assert stats.done == 100 and effect.done == 100
    assert max(effect.most.values()) <= 2, effect.most
    assert effect.most_total >= 6, effect.most_total
    assert set(effect.most) == {f"tenant-{g}" for g in range(4)}


def test_a_concurrency_per_group_holds_across_dispatchers(dsn: str, schema: str) -> None:
    # Two dispatchers in threads, each with its own connections: the cap is counted in
    # PostgreSQL under the effect's lock, so their claims never both take a last slot.
    enqueue(dsn, schema, [NewJob(InFlight.name, f"{g}-{i}", {}, group=f"t{g}")
                          for i in range(15) for g in range(3)])
    effect = InFlight(hold=0.05)
    limits = {InFlight.name: Limit(concurrency=1, per_group=True)}
    errors: list[BaseException] = []

    def run() -> None:
        try:
            Dispatcher(dsn, [effect], schema=schema, concurrency=8,
                       limits=limits).run_until_idle(timeout=120)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert effect.done == 45
    assert max(effect.most.values()) == 1, effect.most


def test_a_rate_per_group_spends_each_groups_own_bucket(dsn: str, schema: str) -> None:
    # 2/s per group with a burst of 1: the first job of each group goes at once, and
    # every later one waits its group's half second, whatever the other groups do.
    enqueue(dsn, schema, [NewJob(InFlight.name, f"{g}-{i}", {}, group=f"g{g}")
                          for i in range(4) for g in range(3)])
    effect = InFlight(hold=0.0)
    Dispatcher(dsn, [effect], schema=schema, concurrency=8,
               limits={InFlight.name: Limit(rate=2.0, burst=1, per_group=True)},
               ).run_until_idle(timeout=120)
    claims = query(dsn, schema, "SELECT group_key, first_attempted_at FROM {schema}.jobs "
                   "ORDER BY group_key, first_attempted_at")
    by_group: dict[str, list[Any]] = {}
    for group, at in claims:
        by_group.setdefault(group, []).append(at)
    assert len(by_group) == 3
    for group, times in by_group.items():
        gaps = [(b - a).total_seconds() for a, b in pairwise(times)]
        # the database's own clock: a bucket of 2/s never lets two claims closer than
        # its refill of one token (less the clock's resolution)
        assert min(gaps) >= 0.49, (group, gaps)
    # the groups' buckets are their own: the three groups' first jobs went together
    firsts = sorted(times[0] for times in by_group.values())
    assert (firsts[-1] - firsts[0]).total_seconds() < 0.49, firsts


class ThrottledFor(Effect):
    """The provider account of group ``refused`` throttles its first ``times`` calls."""

    name = "test.throttled_for"

    def __init__(self, refused: str, times: int, after: float = 2.0) -> None:
        self.refused = refused
        self.times = times
        self.after = after
        self.lock = threading.Lock()
        self.performed: list[tuple[str, float]] = []
        self.throttled_at: float | None = None

    def perform(self, job: Job) -> None:
        with self.lock:
            if job.group == self.refused and self.times > 0:
                self.times -= 1
                self.throttled_at = time.monotonic()
                raise outbox.Throttled(self.after, "429 from the tenant's account")
            self.performed.append((job.group or "", time.monotonic()))


def test_a_throttle_pauses_only_the_refused_group(dsn: str, schema: str) -> None:
    # 5/s per group, a burst of 1: each group's jobs are claimed one by one, so the
    # throttle of slow's first job (Retry-After 2 s) holds back slow's later ones.
    enqueue(dsn, schema, [NewJob(ThrottledFor.name, f"{g}-{i}", {}, group=g)
                          for i in range(5) for g in ("slow", "fast")])
    effect = ThrottledFor(refused="slow", times=1)
    dispatcher = Dispatcher(dsn, [effect], schema=schema, concurrency=4,
                            limits={ThrottledFor.name: Limit(rate=5.0, burst=1,
                                                             per_group=True)})
    runner = threading.Thread(target=dispatcher.run)
    runner.start()
    try:
        deadline = time.monotonic() + 60
        while len(effect.performed) < 10 and time.monotonic() < deadline:
            time.sleep(0.02)  # polling the effect's own record of what it performed
    finally:
        dispatcher.stop()
        runner.join()
    assert effect.throttled_at is not None
    fast = [at for group, at in effect.performed if group == "fast"]
    slow = [at for group, at in effect.performed if group == "slow"]
    assert len(fast) == 5 and len(slow) == 5
    # The fast group's jobs did not wait for the slow group's 2 s pause ...
    assert max(fast) < min(slow), (fast, slow)
    assert min(slow) - effect.throttled_at >= 1.9
    # ... which the shared state holds for that group alone; the effect is not paused.
    rows = query(dsn, schema, "SELECT group_key, throttled_total FROM {schema}.group_limits "
                 "WHERE effect = %s", (ThrottledFor.name,))
    assert dict(rows).get("slow") == 1 and "fast" not in {g for g, n in rows if n}
    paused = query(dsn, schema, "SELECT count(*) FROM {schema}.effect_limits "
                   "WHERE effect = %s AND paused_until IS NOT NULL", (ThrottledFor.name,))
    assert paused == [(0,)]


def test_idle_groups_leave_no_rows(dsn: str, schema: str) -> None:
    enqueue(dsn, schema, [NewJob(InFlight.name, f"k{g}", {}, group=f"g{g}") for g in range(5)])
    effect = InFlight(hold=0.0)
    limits = {InFlight.name: Limit(rate=50.0, per_group=True)}
    Dispatcher(dsn, [effect], schema=schema, limits=limits).run_until_idle(timeout=60)
    assert query(dsn, schema, "SELECT count(*) FROM {schema}.group_limits") == [(5,)]
    # a minute later (moved back in time here), the next claim's sweep removes them
    query(dsn, schema, "UPDATE {schema}.group_limits SET updated_at = now() - interval '2 min' "
          "RETURNING 1")
    query(dsn, schema, "UPDATE {schema}.effect_limits SET groups_swept_at = NULL RETURNING 1")
    enqueue(dsn, schema, [NewJob(InFlight.name, "late", {}, group="g9")])
    Dispatcher(dsn, [effect], schema=schema, limits=limits).run_until_idle(timeout=60)
    assert query(dsn, schema, "SELECT group_key FROM {schema}.group_limits") == [("g9",)]


def test_a_dispatcher_that_does_not_declare_it_honours_a_recent_declaration(
    dsn: str, schema: str,
) -> None:
    enqueue(dsn, schema, [NewJob(InFlight.name, "first", {}, group="t")])
    effect = InFlight(hold=0.0)
    Dispatcher(dsn, [effect], schema=schema,
               limits={InFlight.name: Limit(concurrency=1, per_group=True)},
               ).run_until_idle(timeout=60)
    enqueue(dsn, schema, [NewJob(InFlight.name, f"t-{i}", {}, group="t") for i in range(12)])
    effect = InFlight(hold=0.03)
    Dispatcher(dsn, [effect], schema=schema, concurrency=8).run_until_idle(timeout=60)
    assert effect.done == 12 and effect.most["t"] == 1, effect.most


@pytest.mark.parametrize(("text", "expected"), [
    ("2/s,per_group", Limit(rate=2.0, per_group=True)),
    ("concurrency=3, per_group", Limit(concurrency=3, per_group=True)),
    ("10/s,burst=2", Limit(rate=10.0, burst=2)),
])
def test_the_command_line_form(text: str, expected: Limit) -> None:
    assert parse_limit(text) == expected
    assert parse_limit(str(expected)) == expected


def test_per_group_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="per_group"):
        Limit(rate=1.0, per_group="yes")  # type: ignore[arg-type]


def test_outbox_status_shows_the_groups_a_throttle_paused(dsn: str, schema: str) -> None:
    import json

    from click.testing import CliRunner

    from outbox.cli import main

    enqueue(dsn, schema, [NewJob(ThrottledFor.name, f"acme-{i}", {}, group="acme")
                          for i in range(2)])
    effect = ThrottledFor(refused="acme", times=1, after=600.0)
    dispatcher = Dispatcher(dsn, [effect], schema=schema,
                            limits={ThrottledFor.name: Limit(rate=5.0, per_group=True)})
    runner = threading.Thread(target=dispatcher.run)
    runner.start()
    try:
        deadline = time.monotonic() + 60
        while not query(dsn, schema, "SELECT 1 FROM {schema}.group_limits "
                        "WHERE paused_until > now()") and time.monotonic() < deadline:
            time.sleep(0.02)  # polling the shared state the recorder writes
    finally:
        dispatcher.stop()
        runner.join()
    result = CliRunner().invoke(main, ["status", "--dsn", dsn, "--schema", schema, "--json"])
    assert result.exit_code == 0, result.output
    [throttled] = json.loads(result.output)["throttled_groups"]
    assert (throttled["effect"], throttled["group"], throttled["throttled_total"]) == (
        ThrottledFor.name, "acme", 1)
    assert 500 < throttled["seconds_left"] <= 600
    text = CliRunner().invoke(main, ["status", "--dsn", dsn, "--schema", schema]).output
    assert f"{ThrottledFor.name} group acme: " in text and "(1 refusals)" in text


def test_the_async_dispatcher_caps_each_group_too(dsn: str, schema: str) -> None:
    import asyncio

    class AsyncInFlight(Effect):
        name = "test.async_in_flight"

        def __init__(self) -> None:
            self.now: Counter[str] = Counter()
            self.most: Counter[str] = Counter()

        async def perform(self, job: Job) -> None:
            group = job.group or ""
            self.now[group] += 1
            self.most[group] = max(self.most[group], self.now[group])
            await asyncio.sleep(0.02)  # the provider call's duration
            self.now[group] -= 1

    enqueue(dsn, schema, [NewJob(AsyncInFlight.name, f"{g}-{i}", {}, group=f"g{g}")
                          for i in range(10) for g in range(3)])
    effect = AsyncInFlight()
    dispatcher = outbox.AsyncDispatcher(
        dsn, [effect], schema=schema, concurrency=32,
        limits={AsyncInFlight.name: Limit(concurrency=2, per_group=True)})
    stats = asyncio.run(dispatcher.run_until_idle(timeout=60))
    assert stats.done == 30
    assert effect.most == Counter({"g0": 2, "g1": 2, "g2": 2}), effect.most


def test_a_limited_backlog_leaves_room_for_the_other_effects(dsn: str, schema: str) -> None:
    # A limit per group over many groups rarely runs out of budget: claimed first with
    # all the room, its backlog would hold back every other effect until it drained.
    class Plain(Effect):
        name = "test.plain"

        def __init__(self) -> None:
            self.done = 0

        def perform(self, job: Job) -> None:
            self.done += 1

    enqueue(dsn, schema, [NewJob(InFlight.name, f"l-{i}", {}, group=f"g{i % 100}")
                          for i in range(3000)])
    enqueue(dsn, schema, [NewJob(Plain.name, f"p-{i}", {}) for i in range(20)])
    # slow performs: the dispatcher holds little more than its workers (capacity well
    # under a claim's batch), as with real provider calls
    limited, plain = InFlight(hold=0.02), Plain()
    dispatcher = Dispatcher(dsn, [limited, plain], schema=schema, concurrency=8,
                            limits={InFlight.name: Limit(concurrency=50, per_group=True)})
    runner = threading.Thread(target=dispatcher.run)
    runner.start()
    try:
        deadline = time.monotonic() + 120
        while plain.done < 20 and time.monotonic() < deadline:
            time.sleep(0.02)  # polling the effect's own count
        left = query(dsn, schema, "SELECT count(*) FROM {schema}.jobs "
                     "WHERE effect = %s AND status = 'pending'", (InFlight.name,))[0][0]
    finally:
        dispatcher.stop()
        runner.join()
    assert plain.done == 20
    assert left > 0, "the other effect waited for the whole limited backlog"
