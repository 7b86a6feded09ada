"""The psql session of docs/how-to/other-languages.md, run by psql itself."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import psycopg
from psycopg import sql

from outbox.testing import jobs

from ..test_readme import ROOT

PAGE = ROOT / "docs" / "how-to" / "other-languages.md"


def _session() -> str:
    section = PAGE.read_text().partition("## From psql")[2]
    return section.partition("```sql\n")[2].partition("```")[0]


def test_the_psql_session_enqueues_with_its_order(dsn: str, schema: str) -> None:
    psql = shutil.which("psql") or "/usr/lib/postgresql/15/bin/psql"
    assert os.path.exists(psql), "psql is needed (Debian: apt-get install postgresql-client)"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE TABLE {}.orders (id int PRIMARY KEY, email text)")
                     .format(sql.Identifier(schema)))
    assert re.fullmatch(r"[a-z_][a-z0-9_]*", schema)
    script = _session().replace("outbox.enqueue(", f"{schema}.enqueue(")
    done = subprocess.run(
        [psql, "-X", "-v", "ON_ERROR_STOP=1", "-d", dsn, "-c", f"SET search_path = {schema}",
         "-f", "-"], input=script, text=True, capture_output=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    job = jobs(dsn, schema)["email-order-102"]
    assert (job["payload"], job["group_key"]) == (
        {"order": 102, "to": "ada@example.com"}, "store-7")
    with psycopg.connect(dsn) as conn:
        assert conn.execute(sql.SQL("SELECT id FROM {}.orders").format(
            sql.Identifier(schema))).fetchall() == [(102,)]
