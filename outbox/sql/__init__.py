"""The product's SQL, for tools that run its own statements or seed its tables directly.

For chaos runs, benchmarks and tests that play one step of a worker by hand: the named
blocks of the core's query files (``QUERY_FILES``, one per owner; ``CORE_FILES``, whose
fragments any block may name) bound to a schema, the notification channel, the
fingerprint stored with each job (and the canonical JSON it is taken over, the same text
as the SQL ``<schema>.canonical_json`` makes), the mapping of the SQL ``<schema>.enqueue``
function's refusals to the outbox errors (``enqueue_error``), and the loader for files of
named blocks of your own (with ``-- fragment: X`` blocks bound into the statements that
name ``{X}``; ``core_fragments``: the core's, those rendered from the lifecycle's rules
too). The blocks follow the schema version of this release; applications
enqueue and dispatch through ``outbox.transaction`` and ``outbox.Dispatcher`` instead.
"""

from .._callers import enqueue_error
from .._enqueue import canonical_json, fingerprint, notify_channel
from .._sql import (
    CORE_FILES,
    QUERY_FILES,
    BoundQueries,
    Queries,
    SqlFile,
    bind_blocks,
    bind_schema,
    check_schema_name,
    core_fragments,
    parse_blocks,
    parse_sql,
    queries,
)

__all__ = [  # noqa: RUF022 - in sorted() order, as tests/test_public_api.py checks
    "BoundQueries",
    "CORE_FILES",
    "QUERY_FILES",
    "Queries",
    "SqlFile",
    "bind_blocks",
    "bind_schema",
    "canonical_json",
    "check_schema_name",
    "core_fragments",
    "enqueue_error",
    "fingerprint",
    "notify_channel",
    "parse_blocks",
    "parse_sql",
    "queries",
]
