"""One chunk of hooked outcomes written as the recorder writes it (``writing_hooked``),
on real PostgreSQL, with the positions of the hooks that raise, of a hook whose
statement fails and of a claim fenced out chosen: the hooks' statements go in one
pipeline, so these show what the pipeline must not change. A raising hook settles its
own job (retried, the provider's answer kept) and nothing of it is kept; every other
hook's row is written exactly once; a job whose claim was lost runs no hook and writes
nothing; a cursor's ``rowcount`` is what it is without a pipeline. Each runs for both
flavours: ``Dispatcher``'s plain hooks on a blocking connection, and ``AsyncDispatcher``'s
``async def`` hooks on its asyncio connection, pipelined alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest
from psycopg import sql

import outbox
from outbox import NewJob
from outbox._dispatch.connection import AsyncConnection, Connection, connect
from outbox._dispatch.held import Held, Success
from outbox._dispatch.hooked import HOOKED_SEGMENT, HookedOutcomes, writing_hooked
from outbox._dispatch.recorder import Recorder
from outbox._dispatch.runtime import drive, drive_async
from outbox._dispatch.state import SharedState
from outbox.testing import jobs

EFFECT = "chunk.noop"
CHUNK = 2 * HOOKED_SEGMENT + 6  # three segments: 32, 32 and 6
assert CHUNK == 70


class Noop(outbox.Effect):
    name = EFFECT

    def perform(self, job: outbox.Job) -> dict[str, int]:
        return {"n": 1}


class Broke(Exception):
    """What a steered hook raises."""


@dataclass
class Hook:
    """``on_done``: inserts its job's key into ``hooked`` (primary key: a second insert
    of a key is a statement error) and bumps ``counted``; raises for ``raising``."""

    schema: str
    raising: set[str] = field(default_factory=set)
    refusing: set[str] = field(default_factory=set)  # raise before any statement
    swallowing: set[str] = field(default_factory=set)  # catch an error of their statement
    following: bool = False  # enqueue a follow-up job, "after-<key>"
    waiting: bool = False  # the follow-up waits on its parent: after=[<key>]
    undoing: bool = False  # also insert "undone-<key>" in a savepoint of its own, undone
    collecting: list[bool] = field(default_factory=list)  # gc.isenabled() in each call
    calls: Counter[str] = field(default_factory=Counter)
    rowcounts: list[int] = field(default_factory=list)
    pipelined: list[bool] = field(default_factory=list)

    def __call__(self, tx: outbox.HookTransaction, job: outbox.Job, result: Any) -> None:
        self.calls[job.key] += 1
        if job.key in self.refusing:
            raise Broke(f"hook refused {job.key}")
        self.pipelined.append(bool(tx.connection.pgconn.pipeline_status))
        self.collecting.append(gc.isenabled())
        ident = sql.Identifier(self.schema)
        tx.execute(sql.SQL("INSERT INTO {}.hooked VALUES (%s)").format(ident), (job.key,))
        cursor = tx.execute(sql.SQL("UPDATE {}.counted SET n = n + 1").format(ident))
        self.rowcounts.append(cursor.rowcount)
        if self.following:
            tx.enqueue(EFFECT, key=f"after-{job.key}", payload={},
                       after=[job.key] if self.waiting else None)
        if self.undoing:
            with contextlib.suppress(Broke), tx.connection.transaction():
                tx.execute(sql.SQL("INSERT INTO {}.hooked VALUES (%s)").format(ident),
                           (f"undone-{job.key}",))
                raise Broke("rolled back to the hook's own savepoint")
        if job.key in self.swallowing:
            # Fetching waits for the answer: the error shows here, and is swallowed.
            with contextlib.suppress(psycopg.errors.DivisionByZero):
                tx.execute("SELECT 1 / 0").fetchone()
        if job.key in self.raising:
            raise Broke(f"hook broke for {job.key}")


@dataclass
class AsyncHook(Hook):
    """``Hook`` as an ``async def`` hook of ``AsyncDispatcher``. In the pipeline a
    cursor's ``rowcount`` is not known before its answer (a property cannot wait): it
    raises, and ``await tx.sync()`` waits for it (with ``syncing``)."""

    syncing: bool = False
    unanswered: list[bool] = field(default_factory=list)  # rowcount raised before sync

    async def __call__(  # type: ignore[override]
            self, tx: outbox.AsyncHookTransaction, job: outbox.Job, result: Any) -> None:
        self.calls[job.key] += 1
        if job.key in self.refusing:
            raise Broke(f"hook refused {job.key}")
        self.pipelined.append(bool(tx.connection.pgconn.pipeline_status))
        self.collecting.append(gc.isenabled())
        ident = sql.Identifier(self.schema)
        await tx.execute(sql.SQL("INSERT INTO {}.hooked VALUES (%s)").format(ident),
                         (job.key,))
        if self.following:
            await tx.enqueue(EFFECT, key=f"after-{job.key}", payload={},
                             after=[job.key] if self.waiting else None)
        if self.undoing:
            with contextlib.suppress(Broke):
                async with tx.connection.transaction():
                    await tx.execute(sql.SQL("INSERT INTO {}.hooked VALUES (%s)").format(ident),
                                     (f"undone-{job.key}",))
                    raise Broke("rolled back to the hook's own savepoint")
        cursor = await tx.execute(sql.SQL("UPDATE {}.counted SET n = n + 1").format(ident))
        if self.syncing:
            try:
                self.rowcounts.append(cursor.rowcount)
            except psycopg.InterfaceError as exc:
                assert "await tx.sync()" in str(exc)
                self.unanswered.append(True)
                await tx.sync()
                self.rowcounts.append(cursor.rowcount)
        if job.key in self.swallowing:
            with contextlib.suppress(psycopg.errors.DivisionByZero):
                await (await tx.execute("SELECT 1 / 0")).fetchone()
        if job.key in self.raising:
            raise Broke(f"hook broke for {job.key}")


@dataclass
class Chunk:
    """The jobs ``key(0..n)`` claimed (running, claim 1), and a recorder holding their
    successes, ready for ``writing_hooked``."""

    dsn: str
    schema: str
    hook: Hook
    hooked: HookedOutcomes
    recorder: Recorder
    stats: outbox.DispatchStats
    conn: Connection | AsyncConnection

    def write(self, keys: Iterable[str], fenced: Iterable[str] = ()) -> None:
        """Hand the successes of ``keys`` to the hooked path as one chunk and write it;
        the claims of ``fenced`` taken over by another claim before."""
        wanted = set(keys)
        claimed = self.claim(wanted)
        for k in fenced:
            self.fence_out(k)
        pending = [(held, Success('{"n": 1}')) for held in claimed]
        self.recorder.state.hold(claimed)
        self.hooked.take(pending, self.recorder.settlement)  # type: ignore[arg-type]
        assert not pending and len(self.hooked.items) == len(wanted)
        if isinstance(self.conn, AsyncConnection):
            asyncio.run(self._write_async(self.conn))
        else:
            drive(writing_hooked(self.hooked, self.conn, list(self.hooked.items)))
        assert not self.hooked.items

    async def _write_async(self, conn: AsyncConnection) -> None:
        try:
            await drive_async(writing_hooked(self.hooked, conn, list(self.hooked.items)))
        finally:
            await conn.discard()  # its connection belongs to this event loop

    def claim(self, keys: set[str]) -> list[Held]:
        ident = sql.Identifier(self.schema)
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            rows = conn.execute(sql.SQL(
                "UPDATE {}.jobs SET status = 'running', attempts = attempts + 1,"
                " claim_version = claim_version + 1, claimed_by = 'test',"
                " lease_until = now() + interval '5 minutes',"
                " first_attempted_at = coalesce(first_attempted_at, now())"
                " WHERE key = ANY(%s) RETURNING id, key, attempts, claim_version")
                .format(ident), (sorted(keys),)).fetchall()
        by_key = {key: (id_, attempt, version) for id_, key, attempt, version in rows}
        effect = Noop()
        return [Held(outbox.Job(id=by_key[key][0], effect=EFFECT, key=key, payload={},
                                attempt=by_key[key][1], claim_version=by_key[key][2],
                                max_attempts=5), effect, False)
                for key in sorted(keys, key=_position)]

    def fence_out(self, key: str) -> None:
        """Another claim takes ``key`` over: ours is stale."""
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("UPDATE {}.jobs SET claim_version = claim_version + 1"
                                 " WHERE key = %s").format(sql.Identifier(self.schema)),
                         (key,))

    def rows(self) -> list[str]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            return [key for key, in conn.execute(sql.SQL(
                "SELECT key FROM {}.hooked ORDER BY key").format(sql.Identifier(self.schema)))]

    def counted(self) -> int:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            row = conn.execute(sql.SQL("SELECT n FROM {}.counted").format(
                sql.Identifier(self.schema))).fetchone()
        assert row is not None
        return int(row[0])

    def jobs(self) -> dict[str, dict[str, Any]]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            return jobs(conn, self.schema)


def key(n: int) -> str:
    return f"k{n:03d}"


def _position(k: str) -> int:
    return int(k[1:])


def make_chunk(dsn: str, schema: str, hook: Hook, count: int) -> Chunk:
    """The jobs ``key(0..count)`` pending, and a recorder of the hook's flavour: an
    ``AsyncHook`` is ``AsyncDispatcher``'s, written on an asyncio connection."""
    ident = sql.Identifier(schema)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE TABLE {}.hooked (key text PRIMARY KEY)").format(ident))
        conn.execute(sql.SQL("CREATE TABLE {}.counted (n int NOT NULL)").format(ident))
        conn.execute(sql.SQL("INSERT INTO {}.counted VALUES (0)").format(ident))
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue_many([NewJob(EFFECT, key(n), {}, max_attempts=5) for n in range(count)])
    flavour = outbox.AsyncDispatcher if isinstance(hook, AsyncHook) else outbox.Dispatcher
    dispatcher = flavour(dsn, [Noop()], schema=schema, on_done={EFFECT: hook},
                         backoff=outbox.Backoff(base=60, cap=60))
    settings = dispatcher.settings
    stats = outbox.DispatchStats()
    state: SharedState[threading.Event] = SharedState(stats, settings.observer, 64,
                                                      threading.Event)
    recorder = Recorder(settings, state)
    assert recorder.hooked is not None
    recording: Connection | AsyncConnection = (
        AsyncConnection(settings, "recorder") if isinstance(hook, AsyncHook)
        else Connection(lambda role: connect(settings, role), "recorder"))
    return Chunk(dsn, schema, hook, recorder.hooked, recorder, stats, recording)


@pytest.fixture(params=["sync", "async"])
def chunk_of(dsn: str, schema: str, request: pytest.FixtureRequest,
             ) -> Iterator[Callable[..., Chunk]]:
    """Chunks of the flavour: ``Dispatcher``'s plain hook, or ``AsyncDispatcher``'s
    ``async def`` one."""
    made: list[Chunk] = []
    kind = AsyncHook if request.param == "async" else Hook

    def make(count: int = CHUNK, raising: Iterable[int] = (),
             refusing: Iterable[int] = ()) -> Chunk:
        hook = kind(schema, {key(n) for n in raising}, {key(n) for n in refusing})
        chunk = make_chunk(dsn, schema, hook, count)
        made.append(chunk)
        return chunk

    yield make
    for chunk in made:
        if isinstance(chunk.conn, Connection):
            chunk.conn.discard()


@pytest.mark.parametrize("raising", [
    [0], [HOOKED_SEGMENT - 1], [HOOKED_SEGMENT], [CHUNK - 1],  # 1st, 32nd, 33rd, last
    [3, 17],  # two in one segment
    [0, HOOKED_SEGMENT, CHUNK - 1],  # one in each segment
], ids=lambda r: "raising-" + "-".join(map(str, r)))
def test_a_raising_hook_settles_its_own_job_and_keeps_every_other_row_once(
    chunk_of: Callable[..., Chunk], raising: list[int],
) -> None:
    chunk = chunk_of(raising=raising)
    chunk.write(key(n) for n in range(CHUNK))
    raised = {key(n) for n in raising}
    everyone = {key(n) for n in range(CHUNK)}
    assert chunk.rows() == sorted(everyone - raised)  # each exactly once (primary key)
    assert chunk.counted() == CHUNK - len(raised)  # no write of a raising hook kept
    found = chunk.jobs()
    for k in everyone:
        if k in raised:
            assert found[k]["status"] == "pending", found[k]
            assert "hook broke" in found[k]["last_error"]
            assert found[k]["performed_result"] == {"n": 1}  # not performed again
            assert chunk.hook.calls[k] == 1  # settled from its error, not called again
        else:
            assert found[k]["status"] == "done", found[k]
    assert chunk.stats.done == CHUNK - len(raised)
    assert chunk.stats.retried == len(raised)
    assert chunk.hooked.raising  # the next chunk is written in segments from the start


def test_without_a_raise_each_hook_is_called_once_in_one_pipeline_with_true_rowcounts(
    chunk_of: Callable[..., Chunk],
) -> None:
    chunk = chunk_of()
    if isinstance(chunk.hook, AsyncHook):
        chunk.hook.syncing = True
    chunk.write(key(n) for n in range(CHUNK))
    assert chunk.rows() == [key(n) for n in range(CHUNK)]
    assert set(chunk.hook.calls.values()) == {1}
    assert chunk.hook.pipelined == [True] * CHUNK  # the statements were pipelined...
    assert chunk.hook.rowcounts == [1] * CHUNK  # ...and rowcount still answered
    if isinstance(chunk.hook, AsyncHook):  # (an async hook's, after ``await tx.sync()``)
        assert chunk.hook.unanswered == [True] * CHUNK
    assert chunk.stats.done == CHUNK and not chunk.hooked.raising


def test_a_hook_statement_that_fails_in_the_pipeline_costs_its_own_job_only(
    chunk_of: Callable[..., Chunk], dsn: str, schema: str,
) -> None:
    """The failed insert (a duplicate key) shows only at a later statement or at the
    pipeline's end, whose hook is unknown: the chunk is written again, the segment
    holding it one job at a time, and the failing hook is blamed alone."""
    chunk = chunk_of()
    duplicate = key(40)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("INSERT INTO {}.hooked VALUES (%s)").format(
            sql.Identifier(schema)), (duplicate,))
    chunk.write(key(n) for n in range(CHUNK))
    assert chunk.rows() == [key(n) for n in range(CHUNK)]  # the duplicate's row: ours
    found = chunk.jobs()
    assert found[duplicate]["status"] == "pending"
    assert "UniqueViolation" in found[duplicate]["last_error"] or \
        "duplicate key" in found[duplicate]["last_error"]
    assert all(found[key(n)]["status"] == "done" for n in range(CHUNK) if key(n) != duplicate)
    assert chunk.counted() == CHUNK - 1
    assert chunk.stats.done == CHUNK - 1 and chunk.stats.retried == 1


@pytest.mark.parametrize("raising", [[], [5, HOOKED_SEGMENT + 1]],
                         ids=["none-raising", "two-raising"])
def test_a_claim_fenced_out_among_hooked_ones_runs_no_hook_and_writes_nothing(
    chunk_of: Callable[..., Chunk], raising: list[int],
) -> None:
    chunk = chunk_of(raising=raising)
    fenced = {key(0), key(HOOKED_SEGMENT + 2), key(CHUNK - 1)}
    claimed = [key(n) for n in range(CHUNK)]
    chunk.write(claimed, fenced)
    raised = {key(n) for n in raising}
    assert chunk.rows() == sorted(set(claimed) - fenced - raised)
    assert not any(chunk.hook.calls[k] for k in fenced)  # never called: the fence held
    found = chunk.jobs()
    assert all(found[k]["status"] == "running" for k in fenced)  # left to their new claim
    assert chunk.stats.done == CHUNK - len(fenced) - len(raised)
    assert chunk.stats.retried == len(raised)


def test_after_a_chunk_with_a_raise_the_next_is_written_in_segments_from_the_start(
    chunk_of: Callable[..., Chunk],
) -> None:
    """Optimistically, a raise at job 40 would roll back the 40 hooks called before it
    (each then called twice); in segments, only those of its own segment (32..39)."""
    chunk = chunk_of(count=2 * CHUNK, raising=[1, CHUNK + 40])
    chunk.write(key(n) for n in range(CHUNK))  # the raise at job 1: segments next
    assert chunk.hooked.raising
    chunk.hook.calls.clear()
    chunk.write(key(n) for n in range(CHUNK, 2 * CHUNK))
    calls = [chunk.hook.calls[key(CHUNK + n)] for n in range(CHUNK)]
    assert calls[:HOOKED_SEGMENT] == [1] * HOOKED_SEGMENT
    assert calls[HOOKED_SEGMENT:40] == [2] * (40 - HOOKED_SEGMENT)  # its segment, again
    assert calls[40:] == [1] * (CHUNK - 40)  # the raising one: settled from its error
    assert chunk.rows() == sorted({key(n) for n in range(2 * CHUNK)} - {key(1), key(CHUNK + 40)})
    assert chunk.stats.retried == 2 and chunk.stats.done == 2 * CHUNK - 2


def test_a_hook_that_swallows_its_statement_error_in_the_pipeline_is_blamed_alone(
    chunk_of: Callable[..., Chunk],
) -> None:
    """The swallowed error leaves the transaction aborted: the hooks after it see their
    statements refused by the pipeline (``PipelineAborted``, an ``OperationalError``,
    which must not pass for a lost connection). The chunk is written again, and only
    the swallowing hook's job is retried, as a hook that raised."""
    chunk = chunk_of()
    swallower = key(HOOKED_SEGMENT + 3)
    chunk.hook.swallowing.add(swallower)
    chunk.write(key(n) for n in range(CHUNK))
    assert chunk.rows() == sorted({key(n) for n in range(CHUNK)} - {swallower})
    found = chunk.jobs()
    assert found[swallower]["status"] == "pending"
    assert "transaction aborted" in found[swallower]["last_error"]
    assert all(found[key(n)]["status"] == "done" for n in range(CHUNK) if key(n) != swallower)
    assert chunk.counted() == CHUNK - 1
    assert chunk.stats.done == CHUNK - 1 and chunk.stats.retried == 1


@pytest.mark.parametrize("raising", [[], [3, HOOKED_SEGMENT + 5]],
                         ids=["none-raising", "two-raising"])
def test_follow_ups_are_adopted_in_the_pipeline_and_rolled_back_with_their_hook(
    chunk_of: Callable[..., Chunk], raising: list[int],
) -> None:
    """Each hook enqueues a follow-up, adopted (its parent recorded) in the hooks'
    pipeline: a raising hook's follow-up is rolled back with its segment, every other
    one kept once, its parent the job whose hook enqueued it, in every segment."""
    chunk = chunk_of(raising=raising)
    chunk.hook.following = True
    chunk.write(key(n) for n in range(CHUNK))
    raised = {key(n) for n in raising}
    found = chunk.jobs()
    follow_ups = {k: j for k, j in found.items() if k.startswith("after-")}
    assert sorted(follow_ups) == sorted(f"after-{key(n)}" for n in range(CHUNK)
                                        if key(n) not in raised)
    assert all(j["parent_key"] == k.removeprefix("after-") for k, j in follow_ups.items())
    assert all(found[key(n)]["parent_key"] is None for n in range(CHUNK))
    assert chunk.stats.done == CHUNK - len(raised)


def test_the_garbage_collector_waits_while_the_hooks_run_and_is_back_after(
    chunk_of: Callable[..., Chunk],
) -> None:
    """Paused for the hooks' calls (fewer collections, each walking every object), it is
    on again after the chunk, a raising one included, and left off if it was off."""
    chunk = chunk_of(count=2 * CHUNK, raising=[HOOKED_SEGMENT + 1])
    chunk.write(key(n) for n in range(CHUNK))  # a raise: the chunk written again
    assert chunk.hook.collecting and not any(chunk.hook.collecting)
    assert gc.isenabled()
    gc.disable()
    try:
        chunk.write(key(n) for n in range(CHUNK, 2 * CHUNK))
        assert not gc.isenabled()  # off before: left off
    finally:
        gc.enable()


@pytest.mark.parametrize("raising", [[], [HOOKED_SEGMENT + 2]], ids=["none-raising", "raising"])
def test_a_hooks_own_savepoint_rolled_back_in_the_pipeline_keeps_the_rest(
    chunk_of: Callable[..., Chunk], raising: list[int],
) -> None:
    """A hook that writes inside a savepoint of its own (``tx.connection.transaction()``)
    and rolls it back: in the pipeline, its statements held back, that write alone is
    undone, every other one kept once."""
    chunk = chunk_of(raising=raising)
    chunk.hook.undoing = True
    chunk.write(key(n) for n in range(CHUNK))
    raised = {key(n) for n in raising}
    assert chunk.rows() == sorted({key(n) for n in range(CHUNK)} - raised)
    assert chunk.counted() == CHUNK - len(raised)
    assert chunk.stats.done == CHUNK - len(raised)


def _refused_first(chunk: Chunk) -> None:
    """Write the chunk ``key(0..CHUNK)`` whose hook refuses at job 1 (before any
    statement): the next chunk is written hooks first (``locked``)."""
    chunk.write(key(n) for n in range(CHUNK))
    assert chunk.hooked.raising and not chunk.hooked.dirty
    chunk.hook.calls.clear()


def test_after_hooks_that_refused_before_writing_the_next_chunk_calls_each_hook_once(
    chunk_of: Callable[..., Chunk],
) -> None:
    """Written hooks first, a chunk whose hooks refuse (raise before sending anything)
    rolls nothing back: every other hook is called once (in segments, those of a
    refusing hook's segment before it would be called twice), each refusing job is
    settled from its error, its provider's answer kept, and the next chunk is written
    hooks first again."""
    refusing = [CHUNK + 3, CHUNK + 40, 2 * CHUNK - 1]
    chunk = chunk_of(count=2 * CHUNK, refusing=[1, *refusing])
    _refused_first(chunk)
    chunk.write(key(n) for n in range(CHUNK, 2 * CHUNK))
    assert [chunk.hook.calls[key(n)] for n in range(CHUNK, 2 * CHUNK)] == [1] * CHUNK
    refused = {key(n) for n in [1, *refusing]}
    assert chunk.rows() == sorted({key(n) for n in range(2 * CHUNK)} - refused)
    assert chunk.counted() == 2 * CHUNK - len(refused)
    found = chunk.jobs()
    for k in refused:
        assert found[k]["status"] == "pending", found[k]
        assert "hook refused" in found[k]["last_error"]
        assert found[k]["performed_result"] == {"n": 1}  # not performed again
    assert all(found[key(n)]["status"] == "done" for n in range(2 * CHUNK)
               if key(n) not in refused)
    assert chunk.stats.retried == len(refused)
    assert chunk.stats.done == 2 * CHUNK - len(refused)
    assert chunk.hooked.raising and not chunk.hooked.dirty


def test_written_hooks_first_a_claim_fenced_out_runs_no_hook_and_writes_nothing(
    chunk_of: Callable[..., Chunk],
) -> None:
    """Hooks first, the jobs are locked before any hook is called: a claim lost
    meanwhile is not locked, so its hook is never called (not called and rolled back)."""
    chunk = chunk_of(count=2 * CHUNK, refusing=[1, CHUNK + 10])
    _refused_first(chunk)
    fenced = {key(CHUNK), key(CHUNK + 33), key(2 * CHUNK - 1)}
    claimed = [key(n) for n in range(CHUNK, 2 * CHUNK)]
    chunk.write(claimed, fenced)
    assert not any(chunk.hook.calls[k] for k in fenced)
    assert all(chunk.hook.calls[k] == 1 for k in claimed if k not in fenced)
    refused = {key(1), key(CHUNK + 10)}
    assert chunk.rows() == sorted({key(n) for n in range(2 * CHUNK)} - fenced - refused)
    found = chunk.jobs()
    assert all(found[k]["status"] == "running" for k in fenced)  # left to their new claim
    assert found[key(CHUNK + 10)]["status"] == "pending"
    assert chunk.stats.done == 2 * CHUNK - len(fenced) - len(refused)


def test_written_hooks_first_a_hook_raising_after_writing_sends_the_chunk_to_segments(
    chunk_of: Callable[..., Chunk],
) -> None:
    """A hook that raises after sending its statements cannot be left out alone: the
    chunk written hooks first is rolled back and written again in segments (each hook
    before it called twice), nothing of the raising hook kept; the next chunk goes to
    segments from the start."""
    chunk = chunk_of(count=3 * CHUNK, refusing=[1], raising=[CHUNK + 40, 2 * CHUNK + 40])
    _refused_first(chunk)
    chunk.write(key(n) for n in range(CHUNK, 2 * CHUNK))
    calls = [chunk.hook.calls[key(CHUNK + n)] for n in range(CHUNK)]
    assert calls[:40] == [2] * 40  # the locked attempt, rolled back, then its segments
    assert calls[40:] == [1] * (CHUNK - 40)  # the raising one settled from its error
    assert chunk.hooked.raising and chunk.hooked.dirty
    chunk.hook.calls.clear()
    chunk.write(key(n) for n in range(2 * CHUNK, 3 * CHUNK))
    calls = [chunk.hook.calls[key(2 * CHUNK + n)] for n in range(CHUNK)]
    assert calls[:HOOKED_SEGMENT] == [1] * HOOKED_SEGMENT  # in segments: only its own
    assert calls[HOOKED_SEGMENT:40] == [2] * (40 - HOOKED_SEGMENT)
    raised = {key(1), key(CHUNK + 40), key(2 * CHUNK + 40)}
    assert chunk.rows() == sorted({key(n) for n in range(3 * CHUNK)} - raised)
    assert chunk.counted() == 3 * CHUNK - len(raised)
    assert chunk.stats.retried == len(raised)


@pytest.mark.parametrize("hooks_first", [False, True], ids=["optimistic", "hooks-first"])
def test_a_follow_up_waiting_on_its_parent_is_due_once_the_chunk_commits(
    chunk_of: Callable[..., Chunk], hooks_first: bool,
) -> None:
    """A hook may run before its job's completion is written (hooks first) or after it
    (optimistic): a follow-up it enqueues with ``after=[the job's key]`` is due once the
    chunk commits either way, its parent's result at hand, nothing waiting."""
    chunk = chunk_of(count=2 * CHUNK, refusing=[1] if hooks_first else [])
    first = range(CHUNK)
    if hooks_first:
        _refused_first(chunk)
    else:
        chunk.write(key(n) for n in first)
        assert not chunk.hooked.raising
    chunk.hook.following = chunk.hook.waiting = True
    chunk.write(key(n) for n in range(CHUNK, 2 * CHUNK))
    found = chunk.jobs()
    follow_ups = {k: j for k, j in found.items() if k.startswith("after-")}
    assert sorted(follow_ups) == [f"after-{key(n)}" for n in range(CHUNK, 2 * CHUNK)]
    for k, j in follow_ups.items():
        assert j["status"] == "pending" and j["after_waiting"] == 0, j
        assert j["parent_key"] == k.removeprefix("after-")
    assert chunk.stats.done == 2 * CHUNK - (1 if hooks_first else 0)
