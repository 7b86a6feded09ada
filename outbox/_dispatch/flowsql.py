"""The named blocks of ``sql/flows.sql`` (completion hooks and the reconciler), bound to
a schema and loaded once per process, like the core's query files'."""

from __future__ import annotations

from functools import cache

from .._sql import BoundQueries, bind_file

__all__ = ["flow_queries"]


@cache
def flow_queries(schema: str) -> BoundQueries:
    """The flows' named queries with ``schema`` bound in."""
    return BoundQueries(bind_file("outbox", "sql/flows.sql", schema), "flows.sql")
