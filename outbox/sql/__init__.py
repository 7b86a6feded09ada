"""The product's SQL, for tools that run its own statements or seed its tables directly.

For chaos runs, benchmarks and tests that play one step of a worker by hand: the named
blocks of ``queries.sql`` bound to a schema, the notification channel, the fingerprint
stored with each job, and the loader for files of named blocks of your own (with
``-- fragment: X`` blocks bound into the statements that name ``{X}``). The blocks
follow the schema version of this release; applications enqueue and dispatch through
``outbox.transaction`` and ``outbox.Dispatcher`` instead.
"""

from .._enqueue import fingerprint, notify_channel
from .._sql import (
    BoundQueries,
    Queries,
    SqlFile,
    bind_blocks,
    bind_schema,
    check_schema_name,
    parse_blocks,
    parse_sql,
    queries,
)

__all__ = [
    "BoundQueries",
    "Queries",
    "SqlFile",
    "bind_blocks",
    "bind_schema",
    "check_schema_name",
    "fingerprint",
    "notify_channel",
    "parse_blocks",
    "parse_sql",
    "queries",
]
