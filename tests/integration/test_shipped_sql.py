"""Every SQL file the product ships is checked against a migrated schema: each statement is
PREPAREd (parsed and planned, never run), or, for DDL, run in a transaction rolled back.

A typo, a column renamed by a migration, a fragment that no longer fits: each fails here,
not in a user's dispatcher. A new ``.sql`` file under ``outbox/`` or ``effects/`` must be
added to ``BINDERS`` (how the product binds it), or the first test fails.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from effects.chaos._sql import chaos_queries
from outbox.sql import CORE_FILES, bind_blocks, core_fragments, parse_sql

ROOT = Path(__file__).resolve().parents[2]
CORE = tuple(f"outbox/{path}" for path in CORE_FILES)
PREPARABLE = re.compile(r"^\s*(SELECT|INSERT|UPDATE|DELETE|WITH|VALUES|MERGE)\b", re.I)


def _text(path: str) -> str:
    return (ROOT / path).read_text("utf-8")


def _with_fragments(path: str) -> Callable[[str], dict[str, str]]:
    """A file bound as the product binds it: ``{schema}`` and the core's fragments."""
    def bind(schema: str) -> dict[str, str]:
        found = parse_sql(_text(path))
        return bind_blocks(found.blocks, schema, {**core_fragments(), **found.fragments})
    return bind


# The chaos runner reads every target through views (schema <outbox>_all: each table of
# the targets with a ``target`` column) and locks rows and tables in each target's own.
CHAOS_PER_TARGET = frozenset({"lock_jobs_table", "lock_recorded_jobs"})
CHAOS_VIEWS = ("jobs", "effect_results")


def _chaos(schema: str) -> dict[str, str]:
    on_views = chaos_queries(f"{schema}_all", f"{schema}_chaos")
    on_target = chaos_queries(schema, f"{schema}_chaos")
    return {name: getattr(on_target if name in CHAOS_PER_TARGET else on_views, name)
            for name in parse_sql(_text(CHAOS)).blocks}


def _chaos_schemas(conn: psycopg.Connection[object], schema: str) -> None:
    """The runner's own schema and its views over one target, next to the outbox's."""
    conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(f"{schema}_chaos")))
    conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(f"{schema}_all")))
    for table in CHAOS_VIEWS:
        conn.execute(sql.SQL("CREATE VIEW {}.{} AS SELECT t.*, {}::text AS target "
                             "FROM {}.{} t").format(
            sql.Identifier(f"{schema}_all"), sql.Identifier(table), sql.Literal(schema),
            sql.Identifier(schema), sql.Identifier(table)))


CHAOS = "effects/chaos/queries.sql"
BINDERS: dict[str, Callable[[str], dict[str, str]]] = {
    **{path: _with_fragments(path) for path in CORE},
    "outbox/web/queries.sql": _with_fragments("outbox/web/queries.sql"),
    "outbox/sql/schedules.sql": _with_fragments("outbox/sql/schedules.sql"),
    "outbox/contrib/django/queries.sql": _with_fragments("outbox/contrib/django/queries.sql"),
    CHAOS: _chaos,
    "outbox/sql/replicas.sql": _with_fragments("outbox/sql/replicas.sql"),
    "outbox/testing/queries.sql": _with_fragments("outbox/testing/queries.sql"),
}


def test_every_shipped_sql_file_is_checked() -> None:
    shipped = {str(p.relative_to(ROOT)) for top in ("outbox", "effects")
               for p in (ROOT / top).rglob("*.sql")}
    assert shipped == set(BINDERS), "add the new file to BINDERS (how the product binds it)"


def _numbered(text: str) -> str:
    names: dict[str, int] = {}
    return re.sub(r"%\((\w+)\)s", lambda m: f"${names.setdefault(m[1], len(names) + 1)}", text)


@pytest.mark.parametrize("path", sorted(BINDERS))
def test_every_statement_of_a_shipped_file_is_valid_against_the_schema(
    dsn: str, schema: str, path: str,
) -> None:
    statements = BINDERS[path](schema)
    assert statements, f"{path} has no named statement"
    with psycopg.connect(dsn) as conn:
        if path == CHAOS:
            _chaos_schemas(conn, schema)
        for name, text in statements.items():
            try:
                if PREPARABLE.match(text):
                    handle = sql.Identifier(f"check_{uuid.uuid4().hex[:12]}")
                    conn.execute(sql.SQL("PREPARE {} AS ").format(handle).as_string(conn)
                                 + _numbered(text))
                else:  # DDL: run it, inside the transaction rolled back below
                    conn.execute(text.replace("%%", "%"))
            except psycopg.Error as exc:
                pytest.fail(f"{path}, statement {name!r}: {exc}")
        conn.rollback()
