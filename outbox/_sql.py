"""The named SQL blocks of ``sql/queries.sql``, loaded once, bound to a schema.

SQL never gets built from Python strings here: the only substitution is the schema name,
and it goes in through ``psycopg.sql.Identifier``, which quotes it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import cache
from importlib import resources

from psycopg import sql

from .errors import ConfigurationError

_NAME_LINE = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)
MAX_IDENTIFIER_BYTES = 63


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


def parse_blocks(text: str) -> dict[str, str]:
    """Split a file of ``-- name: X`` blocks into {name: sql}."""
    parts = _NAME_LINE.split(text)
    blocks: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in blocks:
            raise ValueError(f"query {name!r} is defined twice")
        # Comments go: psycopg would read a %(x)s in a comment as a placeholder.
        lines = [ln for ln in body.splitlines() if not ln.lstrip().startswith("--")]
        blocks[name] = "\n".join(lines).strip().rstrip(";")
    return blocks


@cache
def _raw_queries() -> dict[str, str]:
    text = resources.files("outbox").joinpath("sql/queries.sql").read_text("utf-8")
    return parse_blocks(text)


def bind_schema(template: str, schema: str) -> str:
    """Substitute ``{schema}`` in ``template`` with the quoted identifier."""
    composed = sql.SQL(template).format(schema=sql.Identifier(check_schema_name(schema)))
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
    """The named queries with one schema bound in; attribute access by block name."""

    def __init__(self, schema: str) -> None:
        self.schema = schema
        super().__init__({name: bind_schema(body, schema)
                          for name, body in _raw_queries().items()}, "queries.sql")


@cache
def queries(schema: str) -> Queries:
    """The queries for ``schema``, composed once per schema and process."""
    return Queries(schema)
