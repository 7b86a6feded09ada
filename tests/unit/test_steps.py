"""The sans-I/O core every transaction kind runs: queries out, rows in, results out."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from outbox import EnqueueResult, IdempotencyKeyConflict, InvalidKey
from outbox._enqueue import (
    Row,
    enqueue_many_steps,
    enqueue_steps,
    prepare,
    receive_steps,
    run_steps,
    run_steps_async,
)


class Scripted:
    """Answers each named query with the next scripted rows and records what was asked."""

    def __init__(self, *answers: list[Row]) -> None:
        self.answers = list(answers)
        self.asked: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, name: str, params: dict[str, Any]) -> list[Row]:
        self.asked.append((name, params))
        return self.answers.pop(0)


JOB = prepare("email.send", "k1", {"to": "a"})


def test_a_created_job_takes_one_query() -> None:
    db = Scripted([(7, True, None, None)])
    assert run_steps(enqueue_steps(JOB, "chan"), db) == EnqueueResult(7, True)
    assert [name for name, _ in db.asked] == ["enqueue"]
    assert db.asked[0][1]["key"] == "k1" and db.asked[0][1]["channel"] == "chan"


def test_a_key_hidden_by_a_concurrent_insert_is_looked_up() -> None:
    db = Scripted([], [("k1", 9, "email.send", JOB.fingerprint)])
    assert run_steps(enqueue_steps(JOB, "chan"), db) == EnqueueResult(9, False)
    assert [name for name, _ in db.asked] == ["enqueue", "lookup_keys"]


def test_the_same_key_for_another_effect_is_a_conflict() -> None:
    db = Scripted([(9, False, "payment.charge", "other")])
    with pytest.raises(IdempotencyKeyConflict, match="for effect 'payment.charge'"):
        run_steps(enqueue_steps(JOB, "chan"), db)


def test_a_batch_looks_up_only_the_keys_it_did_not_create() -> None:
    other = prepare("email.send", "k2", {"to": "b"})
    db = Scripted([("k1", 3), (None, None)], [("k2", 4, "email.send", other.fingerprint)])
    results = run_steps(enqueue_many_steps([JOB, other, JOB], "chan"), db)
    assert results == [EnqueueResult(3, True), EnqueueResult(4, False), EnqueueResult(3, False)]
    assert db.asked[1] == ("lookup_keys", {"keys": ["k2"]})


def test_an_empty_batch_asks_nothing() -> None:
    db = Scripted()
    assert run_steps(enqueue_many_steps([], "chan"), db) == []
    assert db.asked == []


def test_receive_is_first_when_a_row_comes_back_and_validates_first() -> None:
    assert run_steps(receive_steps("billing", "m1"), Scripted([(True,)])) is True
    assert run_steps(receive_steps("billing", "m1"), Scripted([])) is False
    db = Scripted()
    with pytest.raises(InvalidKey, match="consumer must not be empty"):
        run_steps(receive_steps("", "m1"), db)
    assert db.asked == []


def test_the_async_driver_runs_the_same_steps() -> None:
    db = Scripted([], [("k1", 9, "email.send", JOB.fingerprint)])

    async def execute(name: str, params: dict[str, Any]) -> list[Row]:
        return db(name, params)

    result = asyncio.run(run_steps_async(enqueue_steps(JOB, "chan"), execute))
    assert result == EnqueueResult(9, False)
