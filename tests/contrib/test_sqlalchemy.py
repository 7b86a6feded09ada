"""outbox.contrib.sqlalchemy on real PostgreSQL through the psycopg, psycopg2 and asyncpg
drivers: the jobs commit if and only if the ORM's transaction commits."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import AbstractContextManager, asynccontextmanager, contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import Connection, Engine, Integer, create_engine, insert, select, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import (
    DeclarativeBase,
    Mapped,
    Session,
    mapped_column,
    scoped_session,
    sessionmaker,
)

from outbox import ConfigurationError, IdempotencyKeyConflict, NewJob
from outbox.contrib.sqlalchemy import colon_params, transaction
from outbox.testing import jobs
from outbox.transaction import Transaction as PsycopgTransaction

from ..integration.helpers import fetch, table


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)


def _url(dsn: str, driver: str) -> str:
    assert dsn.startswith("postgresql://")
    return dsn.replace("postgresql://", f"postgresql+{driver}://", 1)


def _orders(dsn: str, schema: str) -> list[int]:
    return [int(r[0]) for r in fetch(dsn, psycopg.sql.SQL("SELECT id FROM {} ORDER BY id")
                                     .format(table(schema, "orders")))]


@pytest.fixture
def orders_table(dsn: str, schema: str) -> str:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(psycopg.sql.SQL("CREATE TABLE {} (id int PRIMARY KEY)")
                     .format(table(schema, "orders")))
    return schema


@pytest.fixture(params=["psycopg", "psycopg2"])
def engine(request: pytest.FixtureRequest, dsn: str, orders_table: str) -> Iterator[Engine]:
    engine = create_engine(_url(dsn, request.param)).execution_options(
        schema_translate_map={None: orders_table})
    yield engine
    engine.dispose()


Opener = Callable[[Engine], AbstractContextManager[Session | Connection]]


@contextmanager
def _session(engine: Engine) -> Iterator[Session]:
    with Session(engine) as session:
        yield session


@contextmanager
def _connection(engine: Engine) -> Iterator[Connection]:
    with engine.connect() as connection:
        yield connection


def _add_order(target: Session | Connection, order_id: int) -> None:
    if isinstance(target, Session):
        target.add(Order(id=order_id))
    else:
        target.execute(insert(Order).values(id=order_id))


@pytest.fixture(params=[_session, _connection], ids=["Session", "Connection"])
def opener(request: pytest.FixtureRequest) -> Opener:
    opener: Opener = request.param
    return opener


def test_block_first_in_the_transaction_then_rollback_leaves_no_job(
    dsn: str, schema: str, engine: Engine, opener: Opener
) -> None:
    with opener(engine) as target:
        with transaction(target, schema=schema) as tx:
            assert tx.enqueue("email.send", key="email-order-1", payload={"n": 1}).created
        _add_order(target, 1)
        assert jobs(dsn, schema) == {}  # the block committed nothing
        target.rollback()
    assert jobs(dsn, schema) == {}
    assert _orders(dsn, schema) == []


def test_block_first_in_the_transaction_then_commit_keeps_job_and_rows(
    dsn: str, schema: str, engine: Engine, opener: Opener
) -> None:
    with opener(engine) as target:
        with transaction(target, schema=schema) as tx:
            result = tx.enqueue("email.send", key="email-order-2", payload={"n": 2})
        _add_order(target, 2)
        target.commit()
    assert jobs(dsn, schema)["email-order-2"]["id"] == result.job_id
    assert _orders(dsn, schema) == [2]


@pytest.mark.parametrize("commit", [True, False])
def test_block_after_other_sql_follows_the_orm_transaction(
    dsn: str, schema: str, engine: Engine, opener: Opener, commit: bool
) -> None:
    with opener(engine) as target:
        _add_order(target, 3)
        with transaction(target, schema=schema) as tx:
            tx.enqueue("email.send", key="email-order-3", payload={})
        if commit:
            target.commit()
        else:
            target.rollback()
    assert list(jobs(dsn, schema)) == (["email-order-3"] if commit else [])
    assert _orders(dsn, schema) == ([3] if commit else [])


def test_an_exception_in_the_block_rolls_back_only_its_jobs(
    dsn: str, schema: str, engine: Engine, opener: Opener
) -> None:
    with opener(engine) as target:
        with transaction(target, schema=schema) as tx:
            tx.enqueue("email.send", key="kept", payload={})
        _add_order(target, 4)
        with pytest.raises(RuntimeError), transaction(target, schema=schema) as tx:
            tx.enqueue("email.send", key="dropped", payload={})
            raise RuntimeError("business rule failed")
        target.commit()
    assert list(jobs(dsn, schema)) == ["kept"]
    assert _orders(dsn, schema) == [4]


def test_a_key_conflict_leaves_the_session_usable(
    dsn: str, schema: str, engine: Engine, opener: Opener
) -> None:
    with opener(engine) as target:
        with transaction(target, schema=schema) as tx:
            tx.enqueue("email.send", key="k", payload={"to": "a"})
        with pytest.raises(IdempotencyKeyConflict), transaction(target, schema=schema) as tx:
            tx.enqueue("payment.charge", key="k", payload={"to": "a"})
        _add_order(target, 5)
        with transaction(target, schema=schema) as tx:
            assert not tx.enqueue("email.send", key="k", payload={"to": "a"}).created
        target.commit()
    assert jobs(dsn, schema)["k"]["effect"] == "email.send"
    assert _orders(dsn, schema) == [5]


def test_inside_an_explicit_begin_the_job_commits_with_it(
    dsn: str, schema: str, engine: Engine
) -> None:
    with Session(engine) as session:
        with session.begin():
            session.add(Order(id=6))
            with transaction(session, schema=schema) as tx:
                tx.enqueue("email.send", key="email-order-6", payload={})
            assert jobs(dsn, schema) == {}
        assert list(jobs(dsn, schema)) == ["email-order-6"]
        with pytest.raises(RuntimeError), session.begin():
            session.add(Order(id=7))
            with transaction(session, schema=schema) as tx:
                tx.enqueue("email.send", key="email-order-7", payload={})
            raise RuntimeError("after the block, before the commit")
    assert list(jobs(dsn, schema)) == ["email-order-6"]
    assert _orders(dsn, schema) == [6]


def test_enqueue_many_and_receive_run_through_the_orm(
    dsn: str, schema: str, engine: Engine, opener: Opener
) -> None:
    batch = [NewJob("email.send", f"m-{i}", {"i": i}) for i in range(3)]
    with opener(engine) as target:
        with transaction(target, schema=schema) as tx:
            assert [r.created for r in tx.enqueue_many(batch)] == [True] * 3
            assert [r.created for r in tx.enqueue_many(batch)] == [False] * 3
            assert tx.receive("billing", "msg-1") is True
            assert tx.receive("billing", "msg-1") is False
        target.commit()
    assert sorted(jobs(dsn, schema)) == ["m-0", "m-1", "m-2"]
    assert fetch(dsn, psycopg.sql.SQL("SELECT message_id FROM {}")
                 .format(table(schema, "inbox"))) == [("msg-1",)]


def test_borrowing_the_driver_connection_is_the_trap_the_contrib_route_avoids(
    dsn: str, schema: str
) -> None:
    """Why the route exists: psycopg's own block on SQLAlchemy's idle driver connection
    begins and commits by itself, so the ORM's rollback cannot take the job back."""
    engine = create_engine(_url(dsn, "psycopg"))
    try:
        with Session(engine) as session:
            driver = session.connection().connection.driver_connection
            assert isinstance(driver, psycopg.Connection)
            with PsycopgTransaction(driver, schema) as tx:
                tx.enqueue("email.send", key="trap", payload={})
            session.rollback()
    finally:
        engine.dispose()
    assert list(jobs(dsn, schema)) == ["trap"]


def test_bad_schema_and_bad_target_are_refused(engine: Engine) -> None:
    with Session(engine) as session:
        with pytest.raises(ConfigurationError, match="schema name"):
            transaction(session, schema="")
        with pytest.raises(TypeError, match="needs a Session, Connection, AsyncSession"):
            transaction(object(), schema="outbox")  # type: ignore[call-overload]
        assert not session.in_transaction()


def test_every_named_block_converts_to_text_parameters() -> None:
    from outbox.sql import queries

    for name in ("enqueue", "enqueue_many", "lookup_keys", "receive", "purge_inbox"):
        converted = colon_params(getattr(queries("outbox"), name))
        bound = set(text(converted).compile().params)
        assert bound == set(__import__("re").findall(r"%\((\w+)\)s",
                                                     getattr(queries("outbox"), name)))
    assert colon_params("SELECT ':x', %(a)s, 1::int") == "SELECT '\\:x', :a, 1::int"
    with pytest.raises(ValueError, match="CAST"):
        colon_params("SELECT %(key)s::text")


# -- asyncio: AsyncSession and AsyncConnection on psycopg and asyncpg ----------------------


@pytest.fixture(params=["psycopg", "asyncpg"])
def async_url(request: pytest.FixtureRequest, dsn: str, orders_table: str) -> str:
    return _url(dsn, request.param)


def _run(url: str, schema: str,
         body: Callable[[AsyncEngine], Coroutine[Any, Any, None]]) -> None:
    async def main() -> None:
        engine = create_async_engine(url).execution_options(
            schema_translate_map={None: schema})
        try:
            await body(engine)
        finally:
            await engine.dispose()
    asyncio.run(main())


@asynccontextmanager
async def _async_target(engine: AsyncEngine, kind: str
                        ) -> AsyncIterator[AsyncSession | AsyncConnection]:
    if kind == "AsyncSession":
        async with AsyncSession(engine) as session:
            yield session
    else:
        async with engine.connect() as connection:
            yield connection


async def _async_add_order(target: AsyncSession | AsyncConnection, order_id: int) -> None:
    if isinstance(target, AsyncSession):
        target.add(Order(id=order_id))
        await target.flush()
    else:
        await target.execute(insert(Order).values(id=order_id))


@pytest.mark.parametrize("kind", ["AsyncSession", "AsyncConnection"])
@pytest.mark.parametrize("commit", [True, False])
def test_async_block_first_follows_the_orm_transaction(
    dsn: str, schema: str, async_url: str, kind: str, commit: bool
) -> None:
    async def body(engine: AsyncEngine) -> None:
        async with _async_target(engine, kind) as target:
            async with transaction(target, schema=schema) as tx:
                assert (await tx.enqueue("email.send", key="a-1", payload={})).created
            await _async_add_order(target, 1)
            assert jobs(dsn, schema) == {}
            await (target.commit() if commit else target.rollback())

    _run(async_url, schema, body)
    assert list(jobs(dsn, schema)) == (["a-1"] if commit else [])
    assert _orders(dsn, schema) == ([1] if commit else [])


@pytest.mark.parametrize("kind", ["AsyncSession", "AsyncConnection"])
def test_async_exception_and_conflict_roll_back_only_the_block(
    dsn: str, schema: str, async_url: str, kind: str
) -> None:
    async def body(engine: AsyncEngine) -> None:
        async with _async_target(engine, kind) as target:
            await _async_add_order(target, 2)
            async with transaction(target, schema=schema) as tx:
                await tx.enqueue("email.send", key="kept", payload={"n": 1})
                assert await tx.receive("billing", "msg-1")
            with pytest.raises(RuntimeError):
                async with transaction(target, schema=schema) as tx:
                    await tx.enqueue("email.send", key="dropped", payload={})
                    raise RuntimeError("business rule failed")
            with pytest.raises(IdempotencyKeyConflict):
                async with transaction(target, schema=schema) as tx:
                    await tx.enqueue("email.send", key="kept", payload={"n": 2})
            async with transaction(target, schema=schema) as tx:
                results = await tx.enqueue_many([NewJob("email.send", "many", {})])
                assert [r.created for r in results] == [True]
            await target.commit()

    _run(async_url, schema, body)
    assert sorted(jobs(dsn, schema)) == ["kept", "many"]
    assert _orders(dsn, schema) == [2]


def test_async_inside_an_explicit_begin(dsn: str, schema: str, async_url: str) -> None:
    async def body(engine: AsyncEngine) -> None:
        async with AsyncSession(engine) as session, session.begin():
            session.add(Order(id=3))
            async with transaction(session, schema=schema) as tx:
                await tx.enqueue("email.send", key="email-order-3", payload={})
            rows = (await session.execute(select(Order.id))).scalars().all()
            assert rows == [3]

    _run(async_url, schema, body)
    assert list(jobs(dsn, schema)) == ["email-order-3"]
    assert _orders(dsn, schema) == [3]


def test_a_scoped_session_stands_for_its_current_session(
    dsn: str, schema: str, engine: Engine
) -> None:
    registry = scoped_session(sessionmaker(engine))
    try:
        registry.add(Order(id=8))
        with transaction(registry, schema=schema) as tx:
            tx.enqueue("email.send", key="email-order-8", payload={})
        registry.rollback()
        assert jobs(dsn, schema) == {}
        with transaction(registry, schema=schema) as tx:
            tx.enqueue("email.send", key="email-order-9", payload={})
        registry.commit()
    finally:
        registry.remove()
    assert list(jobs(dsn, schema)) == ["email-order-9"]


def test_every_enqueue_option_binds_on_every_async_driver(
    dsn: str, schema: str, async_url: str
) -> None:
    async def body(engine: AsyncEngine) -> None:
        async with AsyncSession(engine) as session, session.begin(), \
                transaction(session, schema=schema) as tx:
            await tx.enqueue("email.send", key="later", payload={"x": [1, "ü", None]},
                             run_at=timedelta(hours=1), ordering_key="order-1",
                             max_attempts=3)
            await tx.enqueue("email.send", key="at", payload={},
                             run_at=datetime(2030, 1, 1, tzinfo=UTC))

    _run(async_url, schema, body)
    later, at = jobs(dsn, schema)["later"], jobs(dsn, schema)["at"]
    assert later["payload"] == {"x": [1, "ü", None]}
    assert (later["ordering_key"], later["max_attempts"]) == ("order-1", 3)
    assert later["available_at"] > datetime.now(UTC) + timedelta(minutes=50)
    assert at["available_at"] == datetime(2030, 1, 1, tzinfo=UTC)
