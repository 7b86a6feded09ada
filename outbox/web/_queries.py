"""The dashboard's named SQL blocks (``web/queries.sql``), bound to a schema once."""

from __future__ import annotations

from functools import cache
from importlib import resources

from psycopg import sql

from .._sql import BoundQueries, check_schema_name, parse_blocks

_FRAGMENTS = ("job_filter",)


@cache
def _raw() -> dict[str, str]:
    text = resources.files("outbox.web").joinpath("queries.sql").read_text("utf-8")
    return parse_blocks(text)


class WebQueries(BoundQueries):
    """The dashboard's statements for one schema; attribute access by block name."""

    def __init__(self, schema: str) -> None:
        identifier = sql.Identifier(check_schema_name(schema))
        raw = _raw()
        job_filter = sql.SQL(raw["job_filter"])
        super().__init__({
            name: sql.SQL(body).format(schema=identifier, job_filter=job_filter).as_string(None)
            for name, body in raw.items() if name not in _FRAGMENTS
        }, "web/queries.sql")
        # Table names for has_table_privilege(), quoted as PostgreSQL reads them.
        self.jobs_table = sql.SQL("{}.jobs").format(identifier).as_string(None)
        self.audit_table = sql.SQL("{}.dashboard_audit").format(identifier).as_string(None)


@cache
def web_queries(schema: str) -> WebQueries:
    """The statements for ``schema``, composed once per schema and process."""
    return WebQueries(schema)
