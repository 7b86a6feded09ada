"""The named blocks of ``queries.sql``, loaded once, bound to the two schemas of a run."""

from __future__ import annotations

from functools import cache
from importlib import resources

from psycopg import sql

from outbox.sql import BoundQueries, check_schema_name, parse_blocks

__all__ = ["ChaosQueries", "chaos_queries"]


@cache
def _raw() -> dict[str, str]:
    text = resources.files("effects.chaos").joinpath("queries.sql").read_text("utf-8")
    return parse_blocks(text)


class ChaosQueries(BoundQueries):
    """The runner's queries with ``{schema}`` (outbox) and ``{chaos}`` (audit) bound."""

    def __init__(self, schema: str, chaos: str) -> None:
        identifiers = {"schema": sql.Identifier(check_schema_name(schema)),
                       "chaos": sql.Identifier(check_schema_name(chaos))}
        super().__init__({name: sql.SQL(body).format(**identifiers).as_string(None)
                          for name, body in _raw().items()}, "effects/chaos/queries.sql")


@cache
def chaos_queries(schema: str, chaos: str) -> ChaosQueries:
    """The queries for one pair of schemas, composed once per process."""
    return ChaosQueries(schema, chaos)
