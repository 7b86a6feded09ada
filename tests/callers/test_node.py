"""The Node program of docs/how-to/other-languages.md, run with node-postgres (``pg``,
installed from the npm registry): the order and its job commit in one transaction."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

import outbox
from outbox.testing import jobs

from ..test_readme import ROOT
from .support import Recorder

PAGE = ROOT / "docs" / "how-to" / "other-languages.md"
PG_VERSION = "pg@8"


def _program() -> str:
    [block] = re.findall(r"^```javascript\n(.*?)^```", PAGE.read_text(), re.S | re.M)
    return str(block)


@pytest.fixture(scope="module")
def node_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with ``pg`` installed by npm, and the page's program in it."""
    node, npm = shutil.which("node"), shutil.which("npm")
    assert node and npm, "the Node test needs node and npm (Debian: apt-get install nodejs npm)"
    directory = tmp_path_factory.mktemp("node")
    subprocess.run([npm, "install", PG_VERSION, "--no-audit", "--no-fund", "--silent"],
                   cwd=directory, check=True, timeout=300, capture_output=True)
    return directory


def _run(directory: Path, dsn: str, schema: str, *args: str) -> subprocess.CompletedProcess[str]:
    params = conninfo_to_dict(dsn)
    env = {**os.environ, "PGOPTIONS": f"-c search_path={schema}"}
    for name, variable in (("host", "PGHOST"), ("port", "PGPORT"), ("user", "PGUSER"),
                           ("password", "PGPASSWORD"), ("dbname", "PGDATABASE")):
        if params.get(name) is not None:
            env[variable] = str(params[name])
    assert re.fullmatch(r"[a-z_][a-z0-9_]*", schema)  # used unquoted in the program
    script = directory / f"{schema}.js"
    script.write_text(_program().replace("outbox.enqueue(", f"{schema}.enqueue("))
    return subprocess.run(["node", str(script), *args], cwd=directory, env=env, text=True,
                          capture_output=True, timeout=60, check=False)


class SendEmail(Recorder):
    name = "email.send"


def test_node_enqueues_in_its_own_transaction(node_project: Path, dsn: str,
                                              schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL(
            "CREATE TABLE {s}.customers (email text PRIMARY KEY);"
            "INSERT INTO {s}.customers VALUES ('ada@example.com');"
            # Checked at COMMIT: an unknown customer fails the commit, after the enqueue.
            "CREATE TABLE {s}.orders (id int PRIMARY KEY, email text NOT NULL"
            " REFERENCES {s}.customers DEFERRABLE INITIALLY DEFERRED)"
        ).format(s=sql.Identifier(schema)))

    placed = _run(node_project, dsn, schema, "102", "ada@example.com")
    assert placed.returncode == 0, placed.stderr
    job = jobs(dsn, schema)["email-order-102"]
    assert placed.stdout.strip() == f"order placed, email job {job['id']}"
    assert job["payload"] == {"order": 102, "to": "ada@example.com"}

    # The commit fails after the enqueue: neither the order nor its job remains.
    unknown = _run(node_project, dsn, schema, "103", "nobody@example.com")
    assert unknown.returncode == 1
    assert "23503" in unknown.stderr  # foreign_key_violation, raised by COMMIT

    # The same order again: the business insert fails, no second job.
    again = _run(node_project, dsn, schema, "102", "ada@example.com")
    assert again.returncode == 1 and "23505" in again.stderr

    with psycopg.connect(dsn) as conn:
        orders = conn.execute(sql.SQL("SELECT id FROM {}.orders ORDER BY id")
                              .format(sql.Identifier(schema))).fetchall()
    assert orders == [(102,)]
    assert list(jobs(dsn, schema)) == ["email-order-102"]

    effect = SendEmail()
    outbox.Dispatcher(dsn, [effect], schema=schema).run_until_idle(timeout=30)
    assert effect.calls == {"email-order-102": 1}


def test_node_sees_a_reused_key_as_its_sqlstate(node_project: Path, dsn: str,
                                                schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE TABLE {}.orders (id int PRIMARY KEY, email text)")
                     .format(sql.Identifier(schema)))
        with outbox.transaction(conn, schema=schema) as tx:
            tx.enqueue("email.send", key="email-order-7", payload={"order": 7, "to": "x@y.z"})
    refused = _run(node_project, dsn, schema, "7", "ada@example.com")
    assert refused.returncode == 1
    assert refused.stderr.startswith("OB409 idempotency key 'email-order-7' is already used")
    with psycopg.connect(dsn) as conn:
        assert conn.execute(sql.SQL("SELECT count(*) FROM {}.orders")
                            .format(sql.Identifier(schema))).fetchone() == (0,)
