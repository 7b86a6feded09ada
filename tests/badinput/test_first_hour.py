"""The mistakes of a first hour with outbox, each refused in words that say what to do:
an Effect class for an instance, a misspelt option, a wrong enqueue argument, ``with``
for ``async with`` (and the reverse), a forgotten ``await``, an unmigrated schema, an
unreachable server."""

from __future__ import annotations

import asyncio
import logging
import uuid
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

import outbox
from outbox import AsyncDispatcher, Dispatcher, Effect, InvalidArgument, Job, SchemaError
from outbox.testing import jobs


class SendEmail(Effect):
    name = "email.send"

    def perform(self, job: Job) -> None:
        return None


@pytest.mark.parametrize("kind", [Dispatcher, AsyncDispatcher])
def test_an_effect_class_for_an_instance_says_so(kind: type) -> None:
    with pytest.raises(TypeError, match=r"the class SendEmail, not an instance of it: "
                                        r"pass SendEmail\(\.\.\.\)"):
        kind("dbname=x", [SendEmail])
    with pytest.raises(outbox.ConfigurationError, match="str has no effect name"):
        kind("dbname=x", ["email.send"])


@pytest.mark.parametrize("kind", [Dispatcher, AsyncDispatcher])
def test_a_misspelt_option_names_the_class_and_the_option_meant(kind: type) -> None:
    with pytest.raises(TypeError) as refused:
        kind("dbname=x", [SendEmail()], concurency=4)
    assert str(refused.value) == (f"{kind.__name__}() got an unexpected keyword argument "
                                  "'concurency' (did you mean 'concurrency'?)")
    with pytest.raises(TypeError, match=rf"^{kind.__name__}\(\) got an unexpected keyword "
                                        r"argument 'zzz' \(it takes: conninfo, effects, "):
        kind("dbname=x", [SendEmail()], zzz=1)


@pytest.mark.parametrize(("arguments", "says"), [
    ({"effect": 42}, r"effect must be a non-empty string \(an effect's name, e\.g\. "
                     r"'email\.send'\), got 42"),
    ({"effect": SendEmail()}, r"effect must be the effect's name, a string such as "
                              r"'email\.send', got a SendEmail object"),
    ({"effect": SendEmail}, r"got the class SendEmail: enqueue\('email\.send', \.\.\.\)"),
    ({"max_attempts": "3"}, r"max_attempts must be a positive integer, got '3'"),
    ({"run_at": "tomorrow"}, r"run_at must be a datetime or timedelta, got str 'tomorrow': "
                             r"an aware datetime, or a delay"),
    ({"run_at": datetime(2030, 1, 1)}, r"run_at must be timezone-aware"),
])
def test_a_wrong_enqueue_argument_is_named(
    dsn: str, schema: str, arguments: dict[str, Any], says: str
) -> None:
    call: dict[str, Any] = {"effect": "email.send", "key": "k", "payload": {}, **arguments}
    effect = call.pop("effect")
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx, \
            pytest.raises(InvalidArgument, match=says) as refused:
        tx.enqueue(effect, **call)
    assert isinstance(refused.value, TypeError) and isinstance(refused.value, ValueError)
    assert jobs(dsn, schema) == {}


def test_with_on_an_async_connection_says_async_with(dsn: str, schema: str) -> None:
    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(dsn) as aconn:
            with pytest.raises(TypeError, match=r"open it with `async with`, not `with`"), \
                    outbox.transaction(aconn, schema=schema):
                pass

    asyncio.run(main())
    with psycopg.connect(dsn) as conn:
        tx = outbox.transaction(conn, schema=schema)

        async def reverse() -> None:
            with pytest.raises(TypeError, match=r"open it with `with`, not `async with`"):
                async with tx:
                    pass

        asyncio.run(reverse())


def test_a_forgotten_await_is_found_when_the_block_exits(dsn: str, schema: str) -> None:
    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(dsn) as aconn:
            await aconn.execute("CREATE TEMP TABLE orders (id int)")
            await aconn.commit()
            with pytest.raises(RuntimeError) as refused:
                async with outbox.transaction(aconn, schema=schema) as tx:
                    await aconn.execute("INSERT INTO orders VALUES (102)")
                    await tx.enqueue("email.send", key="awaited", payload={})
                    tx.enqueue("email.send", key="forgotten", payload={})  # type: ignore[unused-coroutine]
            assert str(refused.value) == (
                "tx.enqueue('email.send', key='forgotten', ...) was never awaited, so it "
                "wrote nothing: write `await tx.enqueue(...)`; the block rolled back")
            cursor = await aconn.execute("SELECT count(*) FROM orders")
            assert await cursor.fetchone() == (0,)  # the business write rolled back too

    asyncio.run(main())  # no "coroutine was never awaited" warning (warnings are errors)
    assert jobs(dsn, schema) == {}


def test_enqueue_into_an_unmigrated_schema_says_to_migrate(dsn: str) -> None:
    empty = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(empty)))
    try:
        for schema in ("never_created_here", empty):
            with psycopg.connect(dsn) as conn, pytest.raises(SchemaError) as refused, \
                        outbox.transaction(conn, schema=schema) as tx:
                tx.enqueue("email.send", key="k", payload={})
            assert f"schema {schema!r} has no outbox tables" in str(refused.value)
            assert f"run `outbox migrate --schema {schema}`" in str(refused.value)
            assert isinstance(refused.value.__cause__, psycopg.Error)

        async def main() -> None:
            async with await psycopg.AsyncConnection.connect(dsn) as aconn:
                with pytest.raises(SchemaError, match="run `outbox migrate"):
                    async with outbox.transaction(aconn, schema=empty) as tx:
                        await tx.enqueue_many([outbox.NewJob("email.send", "k", {})])

        asyncio.run(main())
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(empty)))


def test_an_unreachable_server_is_named_with_its_reason_never_the_password(
    caplog: pytest.LogCaptureFixture,
) -> None:
    conninfo = "host=127.0.0.1 port=1 user=app password=s3cret-pw connect_timeout=2"
    with caplog.at_level(logging.WARNING, logger="outbox.dispatcher"), \
            pytest.raises(psycopg.OperationalError):
        Dispatcher(conninfo, [SendEmail()]).run_until_idle(timeout=0.5)
    lines = [r.getMessage() for r in caplog.records]
    assert "cannot reach the database at host 127.0.0.1 port 1: Connection refused; " \
           "retrying" in lines
    assert not any("s3cret-pw" in line for line in lines)


def test_a_delay_is_still_accepted_as_run_at(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        assert tx.enqueue("email.send", key="k", payload={}, run_at=timedelta(1)).created
