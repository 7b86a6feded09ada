"""The named SQL blocks of the product's ``.sql`` files, loaded once, bound to a schema.

SQL never gets built from Python strings here: the substitutions are the schema name,
which goes in through ``psycopg.sql.Identifier`` (quoted), and fragments: a block
declared ``-- fragment: X`` in a file is no statement of its own but SQL text (a
predicate, a CTE) bound into every block that names it as ``{X}``. A rule written once as
a fragment (which jobs a claim takes, which jobs an operator's filter selects) reads the
same in every statement that applies it. The fragments of the core files
(``CORE_FILES``) are bound into every core block and the dashboard's, and with them the
fragments rendered from a rule of the lifecycle (``RENDERED``: the CASE expressions of a
parent's settlement, ``outbox._rule_sql``), so that rule is written once, as data.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources

from psycopg import sql

from ._rule_sql import parent_fragments
from .errors import ConfigurationError

_NAME_LINE = re.compile(r"^-- (name|fragment): (\w+)\s*$", re.MULTILINE)
MAX_IDENTIFIER_BYTES = 63
QUERY_FILES = ("sql/enqueue.sql", "sql/claim.sql", "sql/record.sql", "sql/upkeep.sql",
               "sql/presence.sql", "sql/limits.sql", "sql/operators.sql")
"""The files of ``queries(schema)``'s blocks, one per owner (the transaction kinds, the
claimer, the recorder and rescuer, upkeep, presence, limits, the operators' reads): one
set of names, each defined once among them."""
CORE_FILES = (*QUERY_FILES, "sql/queue.sql", "sql/flows.sql", "sql/after.sql")
"""The core's files of named blocks (package ``outbox``), whose fragments any block uses."""
RENDERED = (parent_fragments,)
"""Functions answering fragments rendered from the lifecycle's rules ({name: sql}), bound
as the core files' fragments are."""


def check_schema_name(schema: str) -> str:
    """Return ``schema`` if PostgreSQL can hold it as an identifier, else raise."""
    if not isinstance(schema, str) or not schema:
        raise ConfigurationError(f"schema name must be a non-empty string, got {schema!r}")
    if len(schema.encode()) > MAX_IDENTIFIER_BYTES or "\x00" in schema:
        raise ConfigurationError(
            f"schema name {schema!r} is not a valid PostgreSQL identifier "
            f"(at most {MAX_IDENTIFIER_BYTES} bytes, no NUL)"
        )
    return schema


@dataclass(frozen=True)
class SqlFile:
    """A file of named blocks: its statements and its fragments, {name: sql} each."""

    blocks: dict[str, str]
    fragments: dict[str, str]


def parse_sql(text: str) -> SqlFile:
    """Split a file of ``-- name: X`` statements and ``-- fragment: X`` fragments."""
    parts = _NAME_LINE.split(text)
    found = SqlFile({}, {})
    for kind, name, body in zip(parts[1::3], parts[2::3], parts[3::3], strict=True):
        if name in found.blocks or name in found.fragments:
            raise ValueError(f"query {name!r} is defined twice")
        # Comments go: psycopg would read a %(x)s in a comment as a placeholder.
        lines = [ln for ln in body.splitlines() if not ln.lstrip().startswith("--")]
        text_of = "\n".join(lines).strip().rstrip(";")
        (found.blocks if kind == "name" else found.fragments)[name] = text_of
    return found


def parse_blocks(text: str) -> dict[str, str]:
    """Split a file of ``-- name: X`` blocks into {name: sql} (fragments left out)."""
    return parse_sql(text).blocks


def bind_blocks(blocks: Mapping[str, str], schema: str,
                fragments: Mapping[str, str] | None = None) -> dict[str, str]:
    """``blocks`` with ``{schema}`` (the quoted identifier) and every ``{fragment}``
    substituted; a fragment may itself name ``{schema}`` and fragments that name no
    other fragment (one level: the claim's fair candidates bind {claimable})."""
    identifier = sql.Identifier(check_schema_name(schema))
    leaves: dict[str, sql.Composable] = {}
    inner: dict[str, str] = {}
    for name, body in (fragments or {}).items():
        try:
            leaves[name] = sql.SQL(body).format(schema=identifier)
        except KeyError:
            inner[name] = body
    try:
        bound = leaves | {name: sql.SQL(body).format(schema=identifier, **leaves)
                          for name, body in inner.items()}
        return {name: sql.SQL(body).format(schema=identifier, **bound).as_string(None)
                for name, body in blocks.items()}
    except KeyError as exc:
        raise ValueError(f"no fragment named {exc.args[0]!r}") from None


@cache
def read_sql(package: str, path: str) -> SqlFile:
    """The blocks and fragments of ``path`` in ``package``, parsed once per process."""
    return parse_sql(resources.files(package).joinpath(path).read_text("utf-8"))


@cache
def core_fragments() -> dict[str, str]:
    """The fragments of every core file and those ``RENDERED``, by name (a name is
    defined once among them)."""
    merged: dict[str, str] = {}
    found = [read_sql("outbox", path).fragments for path in CORE_FILES]
    for fragments in (*found, *(render() for render in RENDERED)):
        for name, body in fragments.items():
            if name in merged:
                raise ValueError(f"fragment {name!r} is defined twice in {CORE_FILES} "
                                 "and RENDERED")
            merged[name] = body
    return merged


def bind_file(package: str, path: str, schema: str) -> dict[str, str]:
    """The statements of ``path`` bound to ``schema``, with the core's fragments and the
    file's own."""
    found = read_sql(package, path)
    return bind_blocks(found.blocks, schema, {**core_fragments(), **found.fragments})


def bind_schema(template: str, schema: str) -> str:
    """Substitute ``{schema}`` in ``template`` with the quoted identifier, and
    ``{channel}`` with the schema's wake-up channel as a string literal (the SQL
    ``enqueue`` function of the migrations notifies it, as ``tx.enqueue`` does)."""
    from ._enqueue import notify_channel

    composed = sql.SQL(template).format(schema=sql.Identifier(check_schema_name(schema)),
                                        channel=sql.Literal(notify_channel(schema)))
    return composed.as_string(None)


class BoundQueries:
    """Named SQL blocks whose identifiers are already bound; attribute access by block
    name. ``source`` names the file the blocks came from, for the error on a typo."""

    def __init__(self, bound: Mapping[str, str], source: str) -> None:
        self._bound = dict(bound)
        self._source = source

    def __getattr__(self, name: str) -> str:
        try:
            return self._bound[name]
        except KeyError:
            raise AttributeError(f"no query named {name!r} in {self._source}") from None


class Queries(BoundQueries):
    """The named queries of ``QUERY_FILES`` with one schema bound in; attribute access by
    block name."""

    def __init__(self, schema: str) -> None:
        self.schema = schema
        bound: dict[str, str] = {}
        for path in QUERY_FILES:
            blocks = bind_file("outbox", path, schema)
            twice = bound.keys() & blocks.keys()
            if twice:
                raise ValueError(f"queries {sorted(twice)} are defined twice in {QUERY_FILES}")
            bound.update(blocks)
        super().__init__(bound, "the files of outbox/sql/ named in QUERY_FILES")


@cache
def queries(schema: str) -> Queries:
    """The queries for ``schema``, composed once per schema and process."""
    return Queries(schema)
