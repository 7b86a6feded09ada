"""The dashboard's named SQL blocks (``web/queries.sql``), bound to a schema once."""

from __future__ import annotations

from functools import cache

from psycopg import sql

from .._sql import BoundQueries, bind_file, check_schema_name


class WebQueries(BoundQueries):
    """The dashboard's statements for one schema; attribute access by block name."""

    def __init__(self, schema: str) -> None:
        identifier = sql.Identifier(check_schema_name(schema))
        # job_filter, shared by the list, its count and the queue model's bulk retry, is
        # a fragment of the core's sql/queue.sql.
        super().__init__(bind_file("outbox.web", "queries.sql", schema), "web/queries.sql")
        # Table names for has_table_privilege(), quoted as PostgreSQL reads them.
        self.jobs_table = sql.SQL("{}.jobs").format(identifier).as_string(None)
        self.audit_table = sql.SQL("{}.dashboard_audit").format(identifier).as_string(None)


@cache
def web_queries(schema: str) -> WebQueries:
    """The statements for ``schema``, composed once per schema and process."""
    return WebQueries(schema)
