"""A configuration that can never work is reported at once, naming the problem and no
secret; a server that is merely unreachable is still waited for."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

import outbox
from outbox import ConfigurationError
from outbox.testing import Server, create_schema, start_server

ROLE = "app_worker"
PASSWORD = "right-Secret-4711"
WRONG = "wrong-Secret-0815"


class Noop(outbox.Effect):
    name = "noop"

    def perform(self, job: outbox.Job) -> None:
        return None


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    """A server of this module's own, where ``ROLE`` must log in with its password."""
    with start_server() as own:
        hba = own.data_dir / "pg_hba.conf"
        hba.write_text(f"local all {ROLE} scram-sha-256\n" + hba.read_text())
        with psycopg.connect(own.dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                sql.Identifier(ROLE), sql.Literal(PASSWORD)))
            conn.execute("SELECT pg_reload_conf()")
        yield own


def _as_role(server: Server, password: str = PASSWORD, **extra: str) -> str:
    return make_conninfo(server.dsn, user=ROLE, password=password, **extra)


def _raises_configuration_error(conninfo: str, schema: str = "outbox") -> str:
    with pytest.raises(ConfigurationError) as raised:
        outbox.Dispatcher(conninfo, [Noop()], schema=schema).run_until_idle()
    return str(raised.value)


def test_a_database_that_does_not_exist(server: Server) -> None:
    message = _raises_configuration_error(make_conninfo(server.dsn, dbname="no_such_db"))
    assert "no_such_db" in message and "does not exist" in message


def test_a_wrong_password_names_the_role_not_the_password(server: Server) -> None:
    message = _raises_configuration_error(_as_role(server, WRONG))
    assert "password authentication failed" in message and ROLE in message
    assert WRONG not in message and PASSWORD not in message


def test_a_role_without_usage_on_the_schema(server: Server) -> None:
    schema = create_schema(server.dsn)
    message = _raises_configuration_error(_as_role(server), schema)
    assert "permission denied" in message and schema in message
    assert PASSWORD not in message


def test_a_role_without_privileges_on_the_tables(server: Server) -> None:
    schema = create_schema(server.dsn)
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(
            sql.Identifier(schema), sql.Identifier(ROLE)))
        conn.execute(sql.SQL("GRANT SELECT ON ALL TABLES IN SCHEMA {} TO {}").format(
            sql.Identifier(schema), sql.Identifier(ROLE)))
    message = _raises_configuration_error(_as_role(server), schema)
    assert "permission denied for table" in message


def test_run_raises_it_too(server: Server) -> None:
    dispatcher = outbox.Dispatcher(make_conninfo(server.dsn, dbname="no_such_db"), [Noop()])
    with pytest.raises(ConfigurationError, match="no_such_db"):
        dispatcher.run()


def test_outbox_run_exits_with_one_line(server: Server, tmp_path: Path) -> None:
    (tmp_path / "wrong_app.py").write_text(textwrap.dedent(f"""
        import outbox

        class Noop(outbox.Effect):
            name = "noop"

            def perform(self, job):
                return None

        dispatcher = outbox.Dispatcher({_as_role(server, WRONG)!r}, [Noop()])
    """))
    result = subprocess.run([sys.executable, "-m", "outbox.cli", "run", "wrong_app:dispatcher"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode != 0
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert "password authentication failed" in lines[0] and WRONG not in lines[0]


def test_an_unreachable_server_is_waited_for_not_refused(tmp_path: Path) -> None:
    nowhere = make_conninfo("", host=str(tmp_path), dbname="postgres", user="postgres")
    with pytest.raises(psycopg.OperationalError) as raised:
        outbox.Dispatcher(nowhere, [Noop()]).run_until_idle(timeout=1.0)
    assert not isinstance(raised.value, ConfigurationError)


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_role_that_may_claim_but_not_record(server: Server, flavour: str) -> None:
    import asyncio

    schema = create_schema(server.dsn)
    with psycopg.connect(server.dsn) as conn:
        with outbox.transaction(conn, schema=schema) as tx:
            tx.enqueue(Noop.name, key="k1", payload={})
        ident = {"s": sql.Identifier(schema), "r": sql.Identifier(ROLE)}
        for grant in ("GRANT USAGE ON SCHEMA {s} TO {r}",
                      "GRANT SELECT, UPDATE, DELETE ON {s}.jobs TO {r}",
                      "GRANT SELECT ON {s}.schema_migrations TO {r}",
                      "GRANT SELECT ON {s}.group_pauses TO {r}",
                      "GRANT SELECT, UPDATE, DELETE ON {s}.after_edges TO {r}",
                      "GRANT SELECT, UPDATE, DELETE ON {s}.effect_results TO {r}",  # no INSERT
                      "GRANT SELECT, UPDATE, DELETE ON {s}.inbox TO {r}",
                      "GRANT SELECT, INSERT, UPDATE ON {s}.effect_limits TO {r}"):
            conn.execute(sql.SQL(grant).format(**ident))
    with pytest.raises(ConfigurationError, match="permission denied for table effect_results"):
        if flavour == "sync":
            outbox.Dispatcher(_as_role(server), [Noop()], schema=schema).run_until_idle()
        else:
            asyncio.run(outbox.AsyncDispatcher(_as_role(server), [Noop()], schema=schema)
                        .run_until_idle())


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_role_that_may_not_purge_the_inbox_is_told_how_to_fix_it(
    server: Server, flavour: str
) -> None:
    import asyncio

    schema = create_schema(server.dsn)
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        ident = {"s": sql.Identifier(schema), "r": sql.Identifier(ROLE)}
        for grant in ("GRANT USAGE ON SCHEMA {s} TO {r}",
                      "GRANT SELECT, UPDATE, DELETE ON {s}.jobs TO {r}",
                      "GRANT SELECT ON {s}.schema_migrations TO {r}",
                      "GRANT SELECT ON {s}.group_pauses TO {r}",
                      "GRANT SELECT, UPDATE, DELETE ON {s}.after_edges TO {r}",
                      "GRANT ALL ON {s}.effect_results TO {r}",
                      "GRANT SELECT, INSERT, UPDATE ON {s}.effect_limits TO {r}"):  # no inbox
            conn.execute(sql.SQL(grant).format(**ident))

    def run(**options: Any) -> outbox.DispatchStats:
        if flavour == "sync":
            return outbox.Dispatcher(_as_role(server), [Noop()], schema=schema,
                                     **options).run_until_idle()
        return asyncio.run(outbox.AsyncDispatcher(_as_role(server), [Noop()], schema=schema,
                                                  **options).run_until_idle())

    with pytest.raises(ConfigurationError) as raised:
        run()
    message = str(raised.value)
    assert "cannot purge the inbox" in message and "permission denied for table inbox" in message
    assert "inbox_retention=None" in message and PASSWORD not in message
    assert run(inbox_retention=None).purged == 0  # the documented way out works


def test_a_malformed_connection_string_is_not_repeated() -> None:
    bad = f"postgresql://{ROLE}:{PASSWORD}@[db/shop"
    message = _raises_configuration_error(bad)
    assert "connection string is not valid" in message and PASSWORD not in message


def test_a_role_that_may_not_record_its_heartbeat_runs_and_says_how_to_fix_it(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    schema = create_schema(server.dsn)
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        ident = {"s": sql.Identifier(schema), "r": sql.Identifier(ROLE)}
        for grant in ("GRANT USAGE ON SCHEMA {s} TO {r}",
                      "GRANT SELECT, UPDATE, DELETE ON {s}.jobs TO {r}",
                      "GRANT SELECT ON {s}.schema_migrations TO {r}",
                      "GRANT SELECT ON {s}.group_pauses TO {r}",
                      "GRANT SELECT, UPDATE, DELETE ON {s}.after_edges TO {r}",
                      "GRANT ALL ON {s}.effect_results TO {r}",
                      "GRANT SELECT, INSERT, UPDATE ON {s}.effect_limits TO {r}",
                      "GRANT ALL ON {s}.inbox TO {r}"):  # nothing on the dispatchers
            conn.execute(sql.SQL(grant).format(**ident))
        with outbox.transaction(conn, schema=schema) as tx:
            tx.enqueue(Noop.name, key="k1", payload={})
    with caplog.at_level(logging.WARNING, logger="outbox.dispatcher"):
        stats = outbox.Dispatcher(_as_role(server), [Noop()], schema=schema).run_until_idle()
    assert stats.done == 1
    [told] = [r.getMessage() for r in caplog.records if "dispatchers" in r.getMessage()]
    assert f"cannot record this dispatcher in {schema}.dispatchers" in told
    assert "grant its role INSERT, UPDATE and DELETE there" in told
