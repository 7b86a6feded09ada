"""The sans-I/O core every transaction kind runs: statements out, rows in, results out."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from outbox import EnqueueResult, IdempotencyKeyConflict, InvalidKey
from outbox._enqueue import (
    enqueue_many_steps,
    enqueue_steps,
    notify_channel,
    prepare,
    receive_steps,
    resolve_steps,
)
from outbox._steps import Rows, Statement, run, run_async, shaped
from outbox.sql import queries

Q = queries("outbox")
NAMES = {getattr(Q, name): name for name in ("enqueue", "enqueue_many", "lookup_keys",
                                             "receive", "resolve_by_event")}
# The columns each block answers, as PostgreSQL names them (the scripted rows' order).
COLUMNS = {"enqueue": ("id", "notified"),
           "enqueue_many": ("key", "id"), "lookup_keys": ("key", "id", "effect", "fingerprint"),
           "receive": ("message_id",), "resolve_by_event": ("id",)}


class Scripted:
    """Answers each statement with the next scripted rows and records what was asked
    (by the name of its block of the core's query files)."""

    def __init__(self, *answers: Rows) -> None:
        self.answers = list(answers)
        self.asked: list[tuple[str, Any]] = []

    def __call__(self, statement: Statement) -> Rows:
        name = NAMES[statement.query]
        self.asked.append((name, statement.params))
        # Shaped as a driver shapes a cursor's rows: named, scalar or plain, as asked.
        return shaped(statement, COLUMNS[name], self.answers.pop(0))


JOB = prepare("email.send", "k1", {"to": "a"})


def test_a_created_job_takes_one_query() -> None:
    db = Scripted([(7, 0)])
    assert run(enqueue_steps(JOB, Q), db) == EnqueueResult(7, True)
    assert [name for name, _ in db.asked] == ["enqueue"]
    assert db.asked[0][1]["key"] == "k1"
    assert db.asked[0][1]["channel"] == notify_channel("outbox")


def test_a_key_hidden_by_a_concurrent_insert_is_looked_up() -> None:
    db = Scripted([], [("k1", 9, "email.send", JOB.fingerprint)])
    assert run(enqueue_steps(JOB, Q), db) == EnqueueResult(9, False)
    assert [name for name, _ in db.asked] == ["enqueue", "lookup_keys"]


def test_the_same_key_for_another_effect_is_a_conflict() -> None:
    db = Scripted([], [("k1", 9, "payment.charge", "other")])
    with pytest.raises(IdempotencyKeyConflict, match="for effect 'payment.charge'"):
        run(enqueue_steps(JOB, Q), db)


def test_a_batch_looks_up_only_the_keys_it_did_not_create() -> None:
    other = prepare("email.send", "k2", {"to": "b"})
    db = Scripted([("k1", 3), (None, None)], [("k2", 4, "email.send", other.fingerprint)])
    results = run(enqueue_many_steps([JOB, other, JOB], Q), db)
    assert results == [EnqueueResult(3, True), EnqueueResult(4, False), EnqueueResult(3, False)]
    assert db.asked[1] == ("lookup_keys", {"keys": ["k2"]})


def test_an_empty_batch_asks_nothing() -> None:
    db = Scripted()
    assert run(enqueue_many_steps([], Q), db) == []
    assert db.asked == []


def test_receive_is_first_when_a_row_comes_back_and_validates_first() -> None:
    assert run(receive_steps("billing", "m1", Q), Scripted([(True,)])) is True
    assert run(receive_steps("billing", "m1", Q), Scripted([])) is False
    db = Scripted()
    with pytest.raises(InvalidKey, match="consumer must not be empty"):
        run(receive_steps("", "m1", Q), db)
    assert db.asked == []


def test_resolve_answers_the_resolved_job_or_none() -> None:
    db = Scripted([(5,)], [])
    assert run(resolve_steps("k1", {"id": "ch_1"}, "webhook", Q), db) == 5
    assert run(resolve_steps("k1", None, "webhook", Q), db) is None
    assert db.asked[0][1]["result"] == '{"id":"ch_1"}' and db.asked[1][1]["result"] == "null"


def test_an_error_of_the_database_reaches_the_caller_unchanged() -> None:
    refused = RuntimeError("the statement failed")

    def execute(statement: Statement) -> Rows:
        raise refused

    with pytest.raises(RuntimeError) as raised:
        run(enqueue_steps(JOB, Q), execute)
    assert raised.value is refused


def test_the_async_driver_runs_the_same_steps() -> None:
    db = Scripted([], [("k1", 9, "email.send", JOB.fingerprint)])

    async def execute(statement: Statement) -> Rows:
        return db(statement)

    result = asyncio.run(run_async(enqueue_steps(JOB, Q), execute))
    assert result == EnqueueResult(9, False)
