"""Bad schemas and bad Dispatcher arguments: refused up front with a message saying what
to do; a hostile schema name is only ever an identifier."""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from psycopg import sql

import outbox
from outbox import ConfigurationError, Dispatcher, Effect, Job, SchemaError
from outbox.cli import main
from outbox.migrate import latest_version, migrations
from outbox.testing import jobs as job_rows
from outbox.testing import ledger as ledger_rows

from ._support import Scripted, enqueue


def _noop() -> Scripted:
    return Scripted(lambda job: None)


@pytest.fixture
def hostile_schema(dsn: str) -> Iterator[tuple[str, str]]:
    """A schema name full of quotes and semicolons, and a canary schema it tries to drop."""
    tag = uuid.uuid4().hex[:8]
    canary = f"canary_{tag}"
    name = f'x"; DROP SCHEMA {canary} CASCADE; --\'{tag}'
    assert len(name.encode()) <= 63
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(canary)))
        conn.execute(sql.SQL("CREATE TABLE {}.alive (n int)").format(sql.Identifier(canary)))
    yield name, canary
    with psycopg.connect(dsn, autocommit=True) as conn:
        for schema in (name, canary):
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def test_schema_name_with_quotes_and_semicolons_works_end_to_end(
    dsn: str, hostile_schema: tuple[str, str]
) -> None:
    name, canary = hostile_schema
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert outbox.migrate(conn, schema=name) == [m.version for m in migrations()]
        assert outbox.migrate(conn, schema=name) == []
    enqueue(dsn, name, "order-1", {"n": 1})
    effect = Scripted(lambda job: {"seen": job.key})
    stats = Dispatcher(dsn, [effect], schema=name).run_until_idle(timeout=60)
    assert stats.done == 1
    assert job_rows(dsn, name)["order-1"]["status"] == "done"
    assert ledger_rows(dsn, name)["order-1"]["result"] == {"seen": "order-1"}
    with psycopg.connect(dsn, autocommit=True) as conn:
        schemas = {row[0] for row in conn.execute(
            "SELECT nspname FROM pg_namespace WHERE nspname = ANY(%s)", ([name, canary],))}
        assert schemas == {name, canary}
        alive = conn.execute(sql.SQL("SELECT count(*) FROM {}.alive").format(
            sql.Identifier(canary))).fetchone()
        assert alive == (0,)
    status = CliRunner().invoke(main, ["status", "--dsn", dsn, "--schema", name, "--json"])
    assert status.exit_code == 0, status.output
    assert '"done": 1' in status.output


def test_dispatcher_on_an_unmigrated_schema(dsn: str) -> None:
    dispatcher = Dispatcher(dsn, [_noop()], schema=f"never_{uuid.uuid4().hex[:8]}")
    with pytest.raises(SchemaError, match=r"has no outbox tables: run `outbox migrate`"):
        dispatcher.run_until_idle(timeout=30)


def _set_versions(dsn: str, schema: str, statement: str) -> None:
    table = sql.SQL("{}.schema_migrations").format(sql.Identifier(schema))
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL(statement).format(table=table))


def test_dispatcher_and_migrate_on_a_newer_schema(dsn: str, schema: str) -> None:
    _set_versions(dsn, schema, "INSERT INTO {table} (version, name) VALUES (999, 'future')")
    with pytest.raises(SchemaError, match=r"version 999, newer than this code knows .*upgrade"):
        Dispatcher(dsn, [_noop()], schema=schema).run_until_idle(timeout=30)
    with psycopg.connect(dsn, autocommit=True) as conn, pytest.raises(
        SchemaError, match=r"version 999, newer than this code knows .*refusing to migrate"
    ):
        outbox.migrate(conn, schema=schema)


def test_dispatcher_on_an_older_schema(dsn: str, schema: str) -> None:
    _set_versions(dsn, schema, "DELETE FROM {table} WHERE version >= 2")
    needs = rf"at version 1, this code needs {latest_version()}: run `outbox migrate`"
    with pytest.raises(SchemaError, match=needs):
        Dispatcher(dsn, [_noop()], schema=schema).run_until_idle(timeout=30)


class _Nameless(Effect):
    def perform(self, job: Job) -> None:
        return None


class _NoPerform:
    name = "test.no-perform"
    perform = None


class _Misnamed(Effect):
    """An effect whose name enqueue would refuse (so none of its jobs could exist)."""

    def __init__(self, name: str) -> None:
        self.name = name  # type: ignore[misc]  # per instance here, a class attribute usually

    def perform(self, job: Job) -> None:
        return None


# (Dispatcher keyword arguments replacing valid ones, pattern the message must match)
BAD_ARGUMENTS: list[Any] = [
    pytest.param({"lease": 0.5}, r"lease must be at least 1\.0 seconds, got 0\.5", id="lease-0.5"),
    pytest.param({"lease": 0}, r"lease must be at least 1\.0", id="lease-0"),
    pytest.param({"lease": -30}, r"lease must be at least 1\.0", id="lease-negative"),
    pytest.param({"lease": math.nan}, r"lease must be at least 1\.0", id="lease-nan"),
    pytest.param({"lease": timedelta(milliseconds=500)}, r"lease must be at least 1\.0",
                 id="lease-timedelta"),
    pytest.param({"lease": "30"}, r"lease must be seconds", id="lease-str"),
    # now() plus such a lease leaves the calendar: every claim failed, nothing claimed
    pytest.param({"lease": 1e300}, r"lease must be at most a century \(3155760000 seconds\), "
                 r"got 1e\+300", id="lease-1e300"),
    pytest.param({"lease": timedelta.max}, r"lease must be at most a century",
                 id="lease-timedelta-max"),
    pytest.param({"retention": math.inf}, r"retention must be at most a century",
                 id="retention-inf"),
    pytest.param({"lease": None}, r"lease must be seconds", id="lease-none"),
    pytest.param({"concurrency": 0}, r"concurrency must be a positive integer, got 0",
                 id="concurrency-0"),
    pytest.param({"concurrency": -4}, r"concurrency .* got -4", id="concurrency-negative"),
    pytest.param({"concurrency": True}, r"concurrency .* got True", id="concurrency-bool"),
    pytest.param({"concurrency": 2.0}, r"concurrency .* got 2\.0", id="concurrency-float"),
    pytest.param({"concurrency": "8"}, r"concurrency .* got '8'", id="concurrency-str"),
    pytest.param({"batch_size": 0}, r"batch_size must be an integer >= 1", id="batch-size-0"),
    pytest.param({"prefetch": -1}, r"prefetch must be an integer >= 0", id="prefetch-negative"),
    pytest.param({"poll_interval": 0}, r"poll_interval must be at least", id="poll-interval-0"),
    pytest.param({"rescue_interval": 0}, r"rescue_interval must be at least",
                 id="rescue-interval-0"),
    pytest.param({"unknown_outcome_window": -1}, r"unknown_outcome_window must be at least",
                 id="window-negative"),
    pytest.param({"retention": timedelta(days=30), "ledger_retention": timedelta(days=1)},
                 r"ledger_retention must not be shorter than retention", id="ledger-shorter"),
    pytest.param({"inbox_retention": -1}, r"inbox_retention must be at least 0",
                 id="inbox-retention-negative"),
    pytest.param({"inbox_retention": "7d"}, r"inbox_retention must be seconds",
                 id="inbox-retention-str"),
    pytest.param({"schema": ""}, r"schema name must be a non-empty string", id="schema-empty"),
    pytest.param({"schema": "s" * 64}, r"not a valid PostgreSQL identifier", id="schema-64"),
    pytest.param({"schema": "a\x00b"}, r"not a valid PostgreSQL identifier", id="schema-nul"),
    pytest.param({"effects": []}, r"needs at least one effect", id="no-effects"),
    pytest.param({"effects": [object()]}, r"object has no effect name", id="effect-object"),
    pytest.param({"effects": [_Nameless()]}, r"_Nameless has no effect name", id="effect-nameless"),
    pytest.param({"effects": [_NoPerform()]}, r"'test.no-perform' has no perform\(\)",
                 id="effect-no-perform"),
    pytest.param({"effects": [_Misnamed("email\x00send")]},
                 r"_Misnamed: effect name 'email\\x00send' has a character that is not "
                 r"printable", id="effect-name-nul"),
    pytest.param({"effects": [_Misnamed("email.send ")]},
                 r"_Misnamed: effect name 'email.send ' has whitespace at its start or end",
                 id="effect-name-padded"),
    pytest.param({"effects": [_noop(), _noop()]}, r"two effects are named 'test.bad'",
                 id="effect-twice"),
    pytest.param({"effects": _noop()}, r"(?i)effects must be .*(list|sequence)",
                 id="effect-not-in-a-list"),
    pytest.param({"backoff": "exponential"}, r"(?i)backoff", id="backoff-str"),
]


@pytest.mark.parametrize(("change", "message"), BAD_ARGUMENTS)
def test_invalid_dispatcher_arguments(dsn: str, change: dict[str, Any], message: str) -> None:
    arguments: dict[str, Any] = {"effects": [_noop()], **change}
    with pytest.raises(ConfigurationError, match=message):
        Dispatcher(dsn, **arguments)
