"""Enqueue inside the business transaction, on real PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row
from pydantic import BaseModel

import outbox
import outbox.sql
from outbox import IdempotencyKeyConflict, InvalidKey, NewJob
from outbox.testing import jobs

from .helpers import fetch, table


def _orders(conn: psycopg.Connection[Any], schema: str) -> None:
    conn.execute(f'CREATE TABLE IF NOT EXISTS "{schema}".orders (id int PRIMARY KEY)')


def test_job_commits_with_the_business_rows(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn) as conn:
        _orders(conn, schema)
        conn.commit()
        with outbox.transaction(conn, schema=schema) as tx:
            conn.execute(f'INSERT INTO "{schema}".orders VALUES (102)')
            result = tx.enqueue("email.send", key="email-order-102", payload={"to": "a@b.c"})
        assert result.created and isinstance(result.job_id, int)
    job = jobs(dsn, schema)["email-order-102"]
    assert (job["status"], job["attempts"], job["claim_version"]) == ("pending", 0, 0)
    assert job["payload"] == {"to": "a@b.c"}
    assert fetch(dsn, f'SELECT count(*) FROM "{schema}".orders') == [(1,)]


def test_rollback_removes_the_job_with_the_business_rows(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn) as conn:
        _orders(conn, schema)
        conn.commit()
        with pytest.raises(RuntimeError), outbox.transaction(conn, schema=schema) as tx:
            conn.execute(f'INSERT INTO "{schema}".orders VALUES (1)')
            tx.enqueue("email.send", key="email-order-1", payload={})
            raise RuntimeError("business rule failed")
    assert jobs(dsn, schema) == {}
    assert fetch(dsn, f'SELECT count(*) FROM "{schema}".orders') == [(0,)]


def test_block_joins_an_open_transaction(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute("SELECT 1")  # the caller's transaction is open
        with outbox.transaction(conn, schema=schema) as tx:
            tx.enqueue("email.send", key="k1", payload={})
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        assert jobs(dsn, schema) == {}  # not committed yet: the caller decides
        conn.rollback()
    assert jobs(dsn, schema) == {}
    with psycopg.connect(dsn) as conn:
        conn.execute("SELECT 1")
        with outbox.transaction(conn, schema=schema) as tx:
            tx.enqueue("email.send", key="k1", payload={})
        conn.commit()
    assert set(jobs(dsn, schema)) == {"k1"}


def test_failed_savepoint_leaves_the_outer_transaction_usable(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute("SELECT 1")
        with pytest.raises(ValueError), outbox.transaction(conn, schema=schema) as tx:
            tx.enqueue("e", key="inner", payload={})
            raise ValueError
        with outbox.transaction(conn, schema=schema) as tx:
            tx.enqueue("e", key="outer", payload={})
        conn.commit()
    assert set(jobs(dsn, schema)) == {"outer"}


def test_duplicate_is_a_no_op_naming_the_existing_job(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        first = tx.enqueue("email.send", key="k", payload={"a": 1, "b": [1, 2]})
        again = tx.enqueue("email.send", key="k", payload={"b": [1, 2], "a": 1})
    assert again == outbox.EnqueueResult(job_id=first.job_id, created=False)
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        later = tx.enqueue("email.send", key="k", payload={"b": [1, 2], "a": 1})
    assert later == again
    assert len(jobs(dsn, schema)) == 1


@pytest.mark.parametrize(("effect", "payload", "detail"), [
    ("email.send", {"a": 2}, "different payload"),
    ("webhook.post", {"a": 1}, "for effect 'email.send', not 'webhook.post'"),
])
def test_same_key_other_request_conflicts(dsn: str, schema: str, effect: str,
                                          payload: dict[str, Any], detail: str) -> None:
    with psycopg.connect(dsn) as conn:
        with outbox.transaction(conn, schema=schema) as tx:
            tx.enqueue("email.send", key="k", payload={"a": 1})
        with pytest.raises(IdempotencyKeyConflict, match="'k'") as info, \
                outbox.transaction(conn, schema=schema) as tx:
            tx.enqueue(effect, key="k", payload=payload)
    assert detail in str(info.value)


def test_key_known_only_to_the_ledger_is_not_enqueued_again(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn) as conn:
        with outbox.transaction(conn, schema=schema) as tx:
            tx.enqueue("e", key="k", payload={"a": 1})
        conn.execute(f'UPDATE "{schema}".jobs SET status = \'running\', lease_until = now(), '
                     "claimed_by = 'w', claim_version = 1")
        conn.execute(outbox.sql.queries(schema).complete,
                     {"claims": '[{"id": 1, "version": 1, "result": {"ok": true}}]'})
        conn.execute(f'DELETE FROM "{schema}".jobs')  # retention removed the done job
        conn.commit()
        with outbox.transaction(conn, schema=schema) as tx:
            assert tx.enqueue("e", key="k", payload={"a": 1}) == outbox.EnqueueResult(None, False)
            with pytest.raises(IdempotencyKeyConflict):
                tx.enqueue("e", key="k", payload={"a": 2})
    assert jobs(dsn, schema) == {}


def test_invalid_key_writes_nothing(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn) as conn, pytest.raises(InvalidKey), \
            outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue("e", key="", payload={})
    assert jobs(dsn, schema) == {}


class Charge(BaseModel):
    amount: int
    currency: str


def test_pydantic_payload_is_stored_as_json(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue("payment.charge", key="p", payload=Charge(amount=500, currency="eur"))
    assert jobs(dsn, schema)["p"]["payload"] == {"amount": 500, "currency": "eur"}


class _Headers(Mapping[str, Any]):
    """A read-only mapping of one's own, not a dict (as frameworks hand out)."""

    def __init__(self, items: dict[str, Any]) -> None:
        self._items = items

    def __getitem__(self, name: str) -> Any:
        return self._items[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


def test_any_mapping_is_a_payload_and_the_same_request_as_its_dict(dsn: str,
                                                                    schema: str) -> None:
    # the contract: a payload is a mapping (any, not only a dict) or a pydantic model
    payload = MappingProxyType({"to": "a@example.com", "meta": _Headers({"b": 1, "a": 2}),
                                "charge": Charge(amount=5, currency="eur")})
    as_dict = {"to": "a@example.com", "meta": {"a": 2, "b": 1},
               "charge": {"amount": 5, "currency": "eur"}}
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        first = tx.enqueue("email.send", key="m", payload=payload)
        again = tx.enqueue("email.send", key="m", payload=as_dict)
        (many,) = tx.enqueue_many([NewJob("email.send", key="n", payload=_Headers(as_dict))])
    assert first.created and again == outbox.EnqueueResult(job_id=first.job_id, created=False)
    assert many.created
    stored = jobs(dsn, schema)
    assert stored["m"]["payload"] == as_dict and stored["n"]["payload"] == as_dict


def test_enqueue_options_are_stored(dsn: str, schema: str) -> None:
    from datetime import timedelta

    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue("e", key="k", payload={}, run_at=timedelta(hours=1), ordering_key="cust-1",
                   max_attempts=3)
    job = jobs(dsn, schema)["k"]
    assert (job["ordering_key"], job["max_attempts"]) == ("cust-1", 3)
    assert job["available_at"] > job["created_at"]


def test_callers_row_factory_does_not_matter(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, row_factory=dict_row) as conn, \
            outbox.transaction(conn, schema=schema) as tx:
        assert tx.enqueue("e", key="k", payload={}).created
        assert not tx.enqueue("e", key="k", payload={}).created


def test_async_enqueue_commits_and_rolls_back(dsn: str, schema: str) -> None:
    async def main() -> None:
        aconn = await psycopg.AsyncConnection.connect(dsn)
        async with aconn:
            async with outbox.transaction(aconn, schema=schema) as tx:
                first = await tx.enqueue("payment.charge", key="payment-order-102",
                                         payload=Charge(amount=1, currency="usd"))
                again = await tx.enqueue("payment.charge", key="payment-order-102",
                                         payload={"currency": "usd", "amount": 1})
                assert first.created and not again.created
                results = await tx.enqueue_many([NewJob("e", "a", {}), NewJob("e", "b", {})])
                assert [r.created for r in results] == [True, True]
            with pytest.raises(KeyError):
                async with outbox.transaction(aconn, schema=schema) as tx:
                    await tx.enqueue("e", key="gone", payload={})
                    raise KeyError("rollback")
            with pytest.raises(IdempotencyKeyConflict):
                async with outbox.transaction(aconn, schema=schema) as tx:
                    await tx.enqueue("payment.charge", key="payment-order-102", payload={})

    asyncio.run(main())
    assert set(jobs(dsn, schema)) == {"payment-order-102", "a", "b"}


def test_enqueue_many_in_one_transaction(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn) as conn:
        with outbox.transaction(conn, schema=schema) as tx:
            tx.enqueue("e", key="k-1", payload={"i": 1})
        with outbox.transaction(conn, schema=schema) as tx:
            results = tx.enqueue_many(
                [NewJob("e", f"k-{i}", {"i": i}) for i in range(5)] + [NewJob("e", "k-4", {"i": 4})]
            )
    assert [r.created for r in results] == [True, False, True, True, True, False]
    assert results[5].job_id == results[4].job_id
    assert len(jobs(dsn, schema)) == 5


def test_enqueue_many_conflict_rolls_back_everything(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn) as conn:
        with outbox.transaction(conn, schema=schema) as tx:
            tx.enqueue("e", key="taken", payload={"i": 1})
        with pytest.raises(IdempotencyKeyConflict), outbox.transaction(conn, schema=schema) as tx:
            tx.enqueue_many([NewJob("e", "new", {}), NewJob("e", "taken", {"i": 2})])
    assert set(jobs(dsn, schema)) == {"taken"}


def test_enqueue_many_names_the_bad_job(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn) as conn, pytest.raises(outbox.InvalidPayload, match="job #1"), \
            outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue_many([NewJob("e", "ok", {}), NewJob("e", "bad", {"x": float("nan")})])


def test_enqueue_notifies_listeners_on_commit(dsn: str, schema: str) -> None:
    channel = outbox.sql.notify_channel(schema)
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute(psycopg.sql.SQL("LISTEN {}").format(psycopg.sql.Identifier(channel)))
        with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
            tx.enqueue("e", key="k", payload={})
        received = list(listener.notifies(timeout=5, stop_after=1))
    assert [n.channel for n in received] == [channel]


def test_schema_with_quotes_and_semicolons(dsn: str) -> None:
    weird = 'shop"; DROP TABLE x; --'
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            outbox.migrate(conn, schema=weird)
        with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=weird) as tx:
            assert tx.enqueue("e", key="k", payload={}).created
        assert fetch(dsn, psycopg.sql.SQL("SELECT key FROM {}").format(table(weird, "jobs"))) == [
            ("k",)]
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(psycopg.sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                psycopg.sql.Identifier(weird)))


def test_transaction_refuses_other_objects() -> None:
    with pytest.raises(TypeError, match="needs a psycopg.Connection"):
        outbox.transaction("postgresql://")  # type: ignore[call-overload]
