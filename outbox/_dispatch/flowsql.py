"""The named blocks of ``sql/flows.sql`` (completion hooks and the reconciler), bound to
a schema and loaded once per process, like ``queries.sql``'s."""

from __future__ import annotations

from functools import cache
from importlib import resources

from .._sql import BoundQueries, bind_schema, parse_blocks

__all__ = ["flow_queries"]


@cache
def _raw() -> dict[str, str]:
    return parse_blocks(resources.files("outbox").joinpath("sql/flows.sql").read_text("utf-8"))


@cache
def flow_queries(schema: str) -> BoundQueries:
    """The flows' named queries with ``schema`` bound in."""
    return BoundQueries({name: bind_schema(body, schema) for name, body in _raw().items()},
                        "flows.sql")
