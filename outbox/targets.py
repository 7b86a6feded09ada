"""Targets: the databases and schemas one dispatcher serves.

An application that splits its data (a database per tenant or shard, or a schema per
tenant in one database) keeps an outbox in each part. ``Dispatcher(effects=...,
targets=[Target(dsn, schema), ...])`` serves them all from one process, within a
connection budget; ``targets`` may be a callable returning the current list, re-read
while running, so a tenant added at run time is served without a restart.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import dict_row

from ._pg import conninfo_problem
from ._sql import check_schema_name
from .errors import ConfigurationError

__all__ = ["Target", "parse_target", "schemas"]


@dataclass(frozen=True, repr=False)
class Target:
    """One outbox a fleet serves: the database at ``dsn`` and the ``schema`` in it.

    ``name`` (``dbname@host:port#schema``) names it in logs, ``outbox status`` and the
    metric ``outbox_target_up{target}``; it never holds the password, and neither does
    the ``repr``. Equal targets (same ``dsn`` and ``schema``) are one target.

    :param dsn: The database's connection string (libpq key=value or a ``postgresql://``
        URL); one that does not parse raises ``outbox.ConfigurationError`` saying why.
    :param schema: The schema holding the outbox tables there.
    """

    dsn: str
    schema: str = "outbox"

    def __post_init__(self) -> None:
        if not isinstance(self.dsn, str) or not self.dsn.strip():
            raise ConfigurationError("Target(dsn=...) must be a non-empty connection string")
        problem = conninfo_problem(self.dsn)  # with no fragment of the string itself
        if problem is not None:
            raise ConfigurationError(
                f"Target(dsn=...) for schema {self.schema!r}: the connection string is "
                f"not valid: {problem}")
        check_schema_name(self.schema)

    @property
    def database(self) -> str:
        """The database part of ``name``: ``dbname@host:port`` (no user, no password)."""
        params = conninfo_to_dict(self.dsn)
        host = str(params.get("host") or params.get("hostaddr") or "localhost")
        port = params.get("port")
        dbname = params.get("dbname") or params.get("user") or "postgres"
        return f"{dbname}@{host}{'' if port is None else f':{port}'}"

    @property
    def name(self) -> str:
        """``dbname@host:port#schema``: the target's name in logs, status and metrics."""
        return f"{self.database}#{self.schema}"

    def __repr__(self) -> str:
        return f"Target({self.name!r})"


_SCHEMA_SUFFIX = re.compile(r"#([^#=\s/]+)$")


def parse_target(text: str) -> Target:
    """A ``Target`` from its command-line form ``DSN[#schema]`` (``outbox run --target``):
    the schema after the last ``#`` when it is a plain name, else ``outbox``."""
    match = _SCHEMA_SUFFIX.search(text)
    if match is None:
        return Target(text)
    return Target(text[:match.start()], match.group(1))


_OUTBOX_SCHEMAS = """
SELECT n.nspname
FROM pg_namespace n
WHERE EXISTS (SELECT 1 FROM pg_class c
              WHERE c.relnamespace = n.oid AND c.relname = 'schema_migrations'
                AND c.relkind IN ('r', 'p'))
  AND EXISTS (SELECT 1 FROM pg_class c
              WHERE c.relnamespace = n.oid AND c.relname = 'jobs' AND c.relkind IN ('r', 'p'))
ORDER BY n.nspname
"""


def schemas(dsn: str) -> list[Target]:
    """Every schema of the database at ``dsn`` that holds an outbox (its ``jobs`` and
    ``schema_migrations`` tables), as targets, in name order: the schema-per-tenant
    layout in one call. Give it as a callable to re-read it while running:
    ``Dispatcher(effects=..., targets=lambda: outbox.targets.schemas(dsn))``."""
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
        names = [row["nspname"] for row in conn.execute(_OUTBOX_SCHEMAS).fetchall()]
    return [Target(dsn, name) for name in names]
