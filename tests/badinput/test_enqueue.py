"""Bad input to ``enqueue`` and ``enqueue_many``: a clear error naming what is wrong,
raised before anything is sent, so nothing is written and the business transaction goes on.
"""

from __future__ import annotations

import asyncio
import math
import re
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest

import outbox
from outbox import EnqueueError, InvalidKey, InvalidPayload, NewJob
from outbox.testing import jobs as job_rows

from ._support import keys


def _nested(levels: int) -> dict[str, Any]:
    payload: dict[str, Any] = {}
    for _ in range(levels):
        payload = {"a": payload}
    return payload


def _circular() -> dict[str, Any]:
    payload: dict[str, Any] = {"name": "loop"}
    payload["self"] = payload
    return payload


class _Opaque:
    """An object json cannot serialise."""


# (enqueue keyword arguments, expected error type, pattern the message must match)
CASES: list[Any] = [
    pytest.param({"key": ""}, InvalidKey, r"key must not be empty", id="empty-key"),
    pytest.param({"key": "k" * 256}, InvalidKey, r"256 characters long; at most 255",
                 id="overlong-key"),
    pytest.param({"key": "order\n102"}, InvalidKey, r"not printable ASCII \('\\n'\) at position 5",
                 id="newline-key"),
    pytest.param({"key": "order\t102"}, InvalidKey, r"not printable ASCII \('\\t'\) at position 5",
                 id="tab-key"),
    pytest.param({"key": "order\x00102"}, InvalidKey,
                 r"not printable ASCII \('\\x00'\) at position 5", id="nul-key"),
    pytest.param({"key": "commande-é"}, InvalidKey, r"not printable ASCII \('é'\) at position 9",
                 id="non-ascii-key"),
    pytest.param({"key": 102}, InvalidKey, r"key must be a string, got int", id="int-key"),
    pytest.param({"ordering_key": ""}, InvalidKey, r"ordering_key must not be empty",
                 id="empty-ordering-key"),
    pytest.param({"payload": {"tags": {"a", "b"}}}, InvalidPayload, r"holds a set",
                 id="set-payload"),
    pytest.param({"payload": {"at": datetime(2026, 1, 1)}}, InvalidPayload, r"holds a datetime",
                 id="datetime-payload"),
    pytest.param({"payload": {"obj": _Opaque()}}, InvalidPayload, r"holds a _Opaque",
                 id="object-payload"),
    pytest.param({"payload": {"raw": b"\x01\x02"}}, InvalidPayload, r"holds a bytes",
                 id="bytes-payload"),
    pytest.param({"payload": {"amount": math.nan}}, InvalidPayload, r"(?i)\bnan\b",
                 id="nan-payload"),
    pytest.param({"payload": {"amount": math.inf}}, InvalidPayload, r"(?i)\binf(inity)?\b",
                 id="infinity-payload"),
    pytest.param({"payload": {"amount": -math.inf}}, InvalidPayload, r"(?i)\binf(inity)?\b",
                 id="minus-infinity-payload"),
    pytest.param({"payload": {"blob": "x" * 1_000_001}}, InvalidPayload,
                 r"1000\d{3} bytes as JSON; at most 1000000", id="over-1mb-payload"),
    pytest.param({"payload": _nested(100_000)}, InvalidPayload, r"nested too deeply",
                 id="nested-1e5-payload"),
    pytest.param({"payload": _circular()}, InvalidPayload, r"(?i)circular", id="circular-payload"),
    pytest.param({"payload": [1, 2]}, InvalidPayload, r"must be a mapping .*got list",
                 id="list-payload"),
    pytest.param({"payload": "text"}, InvalidPayload, r"must be a mapping .*got str",
                 id="str-payload"),
    pytest.param({"payload": None}, InvalidPayload, r"must be a mapping .*got NoneType",
                 id="none-payload"),
    pytest.param({"payload": {"note": "a\x00b"}}, InvalidPayload, r"NUL character",
                 id="nul-in-string"),
    pytest.param({"payload": {"a\x00b": 1}}, InvalidPayload, r"NUL character",
                 id="nul-in-field-name"),
    pytest.param({"payload": {"note": "half \ud800 pair"}}, InvalidPayload, r"(?i)surrogate",
                 id="lone-surrogate"),
    pytest.param({"max_attempts": 0}, EnqueueError, r"max_attempts must be a positive integer, "
                 r"got 0", id="max-attempts-0"),
    pytest.param({"max_attempts": -3}, EnqueueError, r"max_attempts .* got -3",
                 id="max-attempts-negative"),
    pytest.param({"max_attempts": True}, EnqueueError, r"max_attempts .* got True",
                 id="max-attempts-bool"),
    pytest.param({"max_attempts": 2.5}, EnqueueError, r"max_attempts .* got 2.5",
                 id="max-attempts-float"),
    pytest.param({"run_at": datetime(2030, 1, 1, 12, 0)}, EnqueueError,
                 r"run_at must be timezone-aware", id="naive-run-at"),
    pytest.param({"run_at": "2030-01-01T12:00:00Z"}, EnqueueError,
                 r"run_at must be a datetime or timedelta, got str", id="str-run-at"),
    pytest.param({"effect": ""}, EnqueueError, r"effect must be a non-empty string",
                 id="empty-effect"),
    pytest.param({"effect": None}, EnqueueError, r"effect must be a non-empty string",
                 id="none-effect"),
    # Each of these reached the database before, which refused it with its own words and
    # aborted the business transaction (or stored a job nobody could read or perform).
    pytest.param({"max_attempts": 2**31}, EnqueueError,
                 r"max_attempts must be at most 2147483647, got 2147483648",
                 id="max-attempts-past-integer"),
    pytest.param({"effect": "test\x00bad"}, EnqueueError,
                 r"effect name 'test\\x00bad' has a character that is not printable "
                 r"\('\\x00'\) at position 4", id="nul-in-effect"),
    pytest.param({"effect": "test.bad\ud800"}, EnqueueError, r"not printable",
                 id="surrogate-in-effect"),
    pytest.param({"effect": " test.bad "}, EnqueueError, r"whitespace at its start or end",
                 id="padded-effect"),
    pytest.param({"effect": "e" * 256}, EnqueueError,
                 r"effect name is 256 characters long; at most 255", id="effect-256"),
    pytest.param({"group": "tenant\x00"}, EnqueueError,
                 r"group 'tenant\\x00' holds a NUL character", id="nul-in-group"),
    pytest.param({"run_at": timedelta.max}, EnqueueError,
                 r"run_at is a delay of 999999999 days, past the calendar's end",
                 id="run-at-delay-past-the-calendar"),
    pytest.param({"run_at": datetime.min.replace(tzinfo=timezone(timedelta(hours=14)))},
                 EnqueueError, r"outside the calendar \(the years 1 to 9999\) in UTC",
                 id="run-at-before-year-1-in-utc"),
]


def _call(case: dict[str, Any]) -> dict[str, Any]:
    """``enqueue`` arguments: a valid request with ``case`` swapped in."""
    arguments: dict[str, Any] = {"effect": "test.bad", "key": "bad-1", "payload": {"n": 1}}
    arguments.update(case)
    return arguments


@pytest.mark.parametrize(("case", "error", "message"), CASES)
def test_bad_enqueue_is_refused_before_anything_is_sent(
    dsn: str, schema: str, case: dict[str, Any], error: type[EnqueueError], message: str
) -> None:
    arguments = _call(case)
    effect = arguments.pop("effect")
    with psycopg.connect(dsn) as conn:
        with outbox.transaction(conn, schema=schema) as tx:
            with pytest.raises(error) as caught:
                tx.enqueue(effect, **arguments)
            # Refused on the client: the business transaction is not aborted and goes on.
            tx.enqueue("test.bad", key="after-the-error", payload={"n": 2})
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert re.search(message, str(caught.value)), str(caught.value)
    assert keys(dsn, schema) == {"after-the-error"}


def _outcome(error: BaseException) -> tuple[str, str]:
    return type(error).__name__, str(error)


def test_async_enqueue_refuses_exactly_what_sync_enqueue_refuses(dsn: str, schema: str) -> None:
    """Sync and async enqueue share one validation: same error type, same message."""
    sync: list[tuple[str, str]] = []
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        for case in CASES:
            arguments = _call(case.values[0])
            with pytest.raises(Exception) as caught:
                tx.enqueue(arguments.pop("effect"), **arguments)
            sync.append(_outcome(caught.value))

    async def attempt_all() -> list[tuple[str, str]]:
        outcomes = []
        aconn = await psycopg.AsyncConnection.connect(dsn)
        async with aconn, outbox.transaction(aconn, schema=schema) as atx:
            for case in CASES:
                arguments = _call(case.values[0])
                with pytest.raises(Exception) as caught:
                    await atx.enqueue(arguments.pop("effect"), **arguments)
                outcomes.append(_outcome(caught.value))
            await atx.enqueue("test.bad", key="after-the-errors", payload={})
        return outcomes

    assert asyncio.run(attempt_all()) == sync
    assert keys(dsn, schema) == {"after-the-errors"}


def test_limits_are_inclusive(dsn: str, schema: str) -> None:
    """The largest valid key and a payload near the size limit are accepted as given."""
    longest = "k" * 255
    printable = "".join(chr(c) for c in range(0x20, 0x7F))
    big = {"blob": "x" * 999_000}
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue("test.bad", key=longest, payload={})
        tx.enqueue("test.bad", key=printable, payload={}, max_attempts=1)
        tx.enqueue("test.bad", key="big", payload=big)
    rows = job_rows(dsn, schema)
    assert set(rows) == {longest, printable, "big"}
    assert rows[printable]["max_attempts"] == 1
    assert rows["big"]["payload"] == big


def test_text_that_only_looks_like_an_escape_is_stored_verbatim(dsn: str, schema: str) -> None:
    """A literal backslash-u0000 (six characters, e.g. in a regex or a quoted JSON string)
    is not a NUL character: jsonb stores it, so enqueue must not refuse it."""
    payload = {"pattern": "\\u0000", "path": "C:\\u0000\\x"}
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue("test.bad", key="escape-text", payload=payload)
    assert job_rows(dsn, schema)["escape-text"]["payload"] == payload


MANY_CASES: list[Any] = [
    pytest.param(3, {"payload": {"amount": math.nan}}, InvalidPayload, id="nan-payload"),
    pytest.param(2, {"key": "order 2\n"}, InvalidKey, id="bad-key"),
    pytest.param(4, {"max_attempts": 0}, EnqueueError, id="max-attempts-0"),
    pytest.param(0, {"run_at": datetime(2030, 1, 1)}, EnqueueError, id="naive-run-at"),
    pytest.param(1, {"ordering_key": "x" * 300}, InvalidKey, id="bad-ordering-key"),
]


@pytest.mark.parametrize(("index", "change", "error"), MANY_CASES)
def test_enqueue_many_with_one_bad_job_writes_nothing_and_names_it(
    dsn: str, schema: str, index: int, change: dict[str, Any], error: type[EnqueueError]
) -> None:
    batch = [NewJob("test.bad", f"many-{n}", {"n": n}, run_at=timedelta(0)) for n in range(5)]
    fields = {"effect": "test.bad", "key": f"many-{index}", "payload": {"n": index}, **change}
    batch[index] = NewJob(**fields)
    with (
        psycopg.connect(dsn) as conn,
        pytest.raises(error) as caught,
        outbox.transaction(conn, schema=schema) as tx,
    ):
        tx.enqueue_many(batch)
    assert f"job #{index}" in str(caught.value), str(caught.value)
    assert keys(dsn, schema) == set()


@pytest.mark.parametrize("entry", [{"effect": "test.bad", "key": "k", "payload": {}}, None,
                                   ("test.bad", "k", {})])
def test_enqueue_many_with_an_entry_that_is_no_new_job_names_it(
        dsn: str, schema: str, entry: Any) -> None:
    batch = [NewJob("test.bad", "first", {"n": 1}), entry]
    with (
        psycopg.connect(dsn) as conn,
        pytest.raises(EnqueueError, match=r"job #1 must be an outbox\.NewJob\(effect, key, "
                      rf"payload, \.\.\.\), got {type(entry).__name__}"),
        outbox.transaction(conn, schema=schema) as tx,
    ):
        tx.enqueue_many(batch)
    assert keys(dsn, schema) == set()


def test_enqueue_many_with_a_key_reused_inside_the_batch(dsn: str, schema: str) -> None:
    batch = [NewJob("test.bad", "dup", {"n": 1}), NewJob("test.bad", "dup", {"n": 2})]
    with (
        psycopg.connect(dsn) as conn,
        pytest.raises(outbox.IdempotencyKeyConflict, match="'dup'"),
        outbox.transaction(conn, schema=schema) as tx,
    ):
        tx.enqueue_many(batch)
    assert keys(dsn, schema) == set()
