"""``enqueue_many`` on a psycopg connection, blocking or asyncio, sends a large batch in
parts, each prepared while the server inserts the one before (``ENQUEUE_PART``): it
answers and stores exactly what the one-statement path does, and a job refused in a
later part leaves nothing of the batch behind, even when the caller catches the error
and commits.

Each scenario runs on one server in schemas of its own: through the parts
(``Transaction.enqueue_many``, ``AsyncTransaction.enqueue_many``) and through the one
statement (``Operations.enqueue_many``, the path of the SQLAlchemy and Django
transactions), and the schemas are compared."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import psycopg
import pytest
from psycopg import sql

import outbox
from outbox import EnqueueResult, IdempotencyKeyConflict, InvalidKey, InvalidPayload, NewJob
from outbox.testing import create_schema, drop_schema
from outbox.transaction import ENQUEUE_PART, Operations, Transaction, _sent_in_parts

BATCH = 4 * ENQUEUE_PART  # four parts
COLUMNS = ("key", "effect", "payload", "fingerprint", "status", "ordering_key",
           "max_attempts", "group_key", "priority", "attempts")
Enqueue = Callable[[Transaction, Sequence[NewJob]], list[EnqueueResult]]


def in_parts(tx: Transaction, batch: Sequence[NewJob]) -> list[EnqueueResult]:
    assert _sent_in_parts(batch, tx.connection)
    return tx.enqueue_many(batch)


def in_one_statement(tx: Transaction, batch: Sequence[NewJob]) -> list[EnqueueResult]:
    return Operations.enqueue_many(tx, batch)


def in_parts_async(dsn: str, schema: str, batch: Sequence[NewJob]) -> list[EnqueueResult]:
    """The batch in parts through ``AsyncTransaction``, in a transaction of its own."""
    async def enqueue() -> list[EnqueueResult]:
        async with (await psycopg.AsyncConnection.connect(dsn) as conn,
                    outbox.transaction(conn, schema=schema) as tx):
            assert _sent_in_parts(batch, conn)
            return await tx.enqueue_many(batch)
    return asyncio.run(enqueue())


@pytest.fixture
def other_schema(dsn: str) -> Iterator[str]:
    name = create_schema(dsn)
    yield name
    drop_schema(dsn, name)


def _rows(conn: psycopg.Connection[Any], schema: str) -> list[tuple[Any, ...]]:
    return conn.execute(sql.SQL("SELECT {} FROM {}.jobs ORDER BY id").format(
        sql.SQL(", ").join(map(sql.Identifier, COLUMNS)), sql.Identifier(schema))).fetchall()


def _ledger(conn: psycopg.Connection[Any], schema: str, key: str, payload: dict[str, Any]) -> None:
    """A ledger row for ``key`` as a job done and retired leaves it."""
    with outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue("test.parts", key=key, payload=payload)
    conn.execute(sql.SQL(
        "INSERT INTO {s}.effect_results (key, effect, job_id, claim_version, fingerprint, result)"
        " SELECT key, effect, id, 1, fingerprint, '{{}}'::jsonb FROM {s}.jobs WHERE key = %s"
    ).format(s=sql.Identifier(schema)), (key,))
    conn.execute(sql.SQL("DELETE FROM {}.jobs WHERE key = %s").format(
        sql.Identifier(schema)), (key,))
    conn.commit()


def _batch() -> list[NewJob]:
    """Every part holds something: new keys with every optional field, a key known as
    a job, a key known only to the ledger, and repeats of keys of earlier parts."""
    jobs = []
    for n in range(BATCH):
        options: dict[str, Any] = {}
        if n % 7 == 0:
            options = {"ordering_key": f"line-{n % 3}", "max_attempts": 4,
                       "group": f"tenant-{n % 5}", "priority": n % 11 - 5}
        jobs.append(NewJob("test.parts", key=f"k-{n}", payload={"n": n}, **options))
    for part in range(1, 4):  # a repeat of the part before's job, same request
        at, of = part * ENQUEUE_PART + 3, (part - 1) * ENQUEUE_PART + 2
        jobs[at] = NewJob("test.parts", key=f"k-{of}", payload={"n": of}, **_options(jobs[of]))
    jobs[ENQUEUE_PART + 9] = NewJob("test.parts", key="known-job", payload={"known": 1})
    jobs[3 * ENQUEUE_PART + 1] = NewJob("test.parts", key="known-ledger", payload={"done": 1})
    return jobs


def _options(job: NewJob) -> dict[str, Any]:
    return {"ordering_key": job.ordering_key, "max_attempts": job.max_attempts,
            "group": job.group, "priority": job.priority}


def _scenario(conn: psycopg.Connection[Any], schema: str, enqueue: Enqueue
              ) -> tuple[list[tuple[bool, int]], list[tuple[Any, ...]], list[tuple[bool, int]]]:
    """The batch into ``schema`` after its known keys, then the same batch again: the
    results (created, the job's place among the schema's ids) and the stored rows."""
    with outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue("test.parts", key="known-job", payload={"known": 1})
    _ledger(conn, schema, "known-ledger", {"done": 1})
    with outbox.transaction(conn, schema=schema) as tx:
        first = enqueue(tx, _batch())
    with outbox.transaction(conn, schema=schema) as tx:
        again = enqueue(tx, _batch())
    ids = sorted(r[0] for r in conn.execute(sql.SQL("SELECT id FROM {}.jobs").format(
        sql.Identifier(schema))).fetchall())

    def placed(results: list[EnqueueResult]) -> list[tuple[bool, int]]:
        return [(r.created, -1 if r.job_id is None else ids.index(r.job_id)) for r in results]

    return placed(first), _rows(conn, schema), placed(again)


def test_a_batch_in_parts_answers_and_stores_what_one_statement_does(
        dsn: str, schema: str, other_schema: str) -> None:
    with psycopg.connect(dsn) as conn:
        parts = _scenario(conn, schema, in_parts)
        one = _scenario(conn, other_schema, in_one_statement)
    assert parts == one
    first, rows, again = parts
    assert len(rows) == BATCH - 3 - 2 + 1  # repeats and known keys stored once; known-job
    assert sum(created for created, _ in first) == BATCH - 5
    assert not any(created for created, _ in again)
    assert [place for _, place in again] == [place for _, place in first]


def test_a_batch_in_parts_on_asyncio_answers_and_stores_what_one_statement_does(
        dsn: str, schema: str, other_schema: str) -> None:
    with psycopg.connect(dsn) as conn:
        one = _scenario(conn, other_schema, in_one_statement)

        def on_asyncio(tx: Transaction, batch: Sequence[NewJob]) -> list[EnqueueResult]:
            return in_parts_async(dsn, schema, batch)  # its own connection and transaction

        parts = _scenario(conn, schema, on_asyncio)
    assert parts == one


def _refused_batch(refusal: str) -> tuple[list[NewJob], int, type[Exception]]:
    batch = [NewJob("test.parts", key=f"r-{n}", payload={"n": n}) for n in range(BATCH)]
    last = BATCH - 2
    expected: type[Exception]
    if refusal == "key":
        batch[last] = NewJob("test.parts", key="bad key\n", payload={})
        expected = InvalidKey
    elif refusal == "payload":
        batch[last] = NewJob("test.parts", key="r-x", payload={"at": object()})
        expected = InvalidPayload
    else:  # a repeat of the first part's key with another payload
        batch[last] = NewJob("test.parts", key="r-5", payload={"n": "other"})
        expected = IdempotencyKeyConflict
    return batch, last, expected


@pytest.mark.parametrize("enqueue", [in_parts, in_one_statement])
@pytest.mark.parametrize("refusal", ["key", "payload", "conflict"])
def test_a_job_refused_in_the_last_part_leaves_nothing_of_the_batch(
        dsn: str, schema: str, enqueue: Enqueue, refusal: str) -> None:
    batch, last, expected = _refused_batch(refusal)
    with psycopg.connect(dsn) as conn:
        with outbox.transaction(conn, schema=schema) as tx:
            with pytest.raises(expected) as refused:
                enqueue(tx, batch)
            # the caller goes on in the same transaction, which commits
            kept = tx.enqueue("test.parts", key="after-the-refusal", payload={})
        assert kept.created
        if refusal != "conflict":
            assert f"job #{last}" in str(refused.value)
        assert [row[0] for row in _rows(conn, schema)] == ["after-the-refusal"]


@pytest.mark.parametrize("refusal", ["key", "payload", "conflict"])
def test_on_asyncio_a_job_refused_in_the_last_part_leaves_nothing_of_the_batch(
        dsn: str, schema: str, refusal: str) -> None:
    batch, last, expected = _refused_batch(refusal)

    async def caught_then_committed() -> None:
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            async with outbox.transaction(conn, schema=schema) as tx:
                assert _sent_in_parts(batch, conn)
                with pytest.raises(expected) as refused:
                    await tx.enqueue_many(batch)
                await tx.enqueue("test.parts", key="after-the-refusal", payload={})
            if refusal != "conflict":
                assert f"job #{last}" in str(refused.value)

    asyncio.run(caught_then_committed())
    with psycopg.connect(dsn) as conn:
        assert [row[0] for row in _rows(conn, schema)] == ["after-the-refusal"]


def test_the_parts_are_taken_only_where_they_pay(dsn: str, schema: str) -> None:
    batch = [NewJob("test.parts", key=f"p-{n}", payload={}) for n in range(2 * ENQUEUE_PART)]
    with psycopg.connect(dsn) as conn:
        assert _sent_in_parts(batch, conn)
        assert not _sent_in_parts(batch[1:], conn)  # fewer than two parts
        waiting = [*batch[:-1], NewJob("test.parts", key="child", payload={}, after=["p-0"])]
        assert not _sent_in_parts(waiting, conn)  # parents are checked for the whole batch
        with conn.pipeline():  # inside the caller's pipeline: one statement
            assert not _sent_in_parts(batch, conn)


def test_a_batch_in_parts_inside_a_nested_block_and_a_generator(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn) as conn:
        with conn.transaction(), outbox.transaction(conn, schema=schema) as tx:
            results = tx.enqueue_many(
                NewJob("test.parts", key=f"g-{n}", payload={"n": n}) for n in range(BATCH))
        assert all(r.created for r in results)
        ids = [r.job_id or 0 for r in results]
        assert 0 not in ids and ids == sorted(ids)  # in the batch's order
        assert [row[0] for row in _rows(conn, schema)] == [f"g-{n}" for n in range(BATCH)]
