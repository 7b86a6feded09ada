"""The pure parts of a dashboard over several outboxes: the targets' slugs in its URLs,
the list a ``targets=`` source gives, and why a target cannot be shown (never the
password).

A target's slug is its name (``dbname@host:port#schema``) with ``#`` written ``~``:
``/t/shop@db1:5432~tenant_a/jobs``. It depends on the target alone, so a link stays
good while targets come and go. A name holding anything but letters, digits and
``._-@:`` around its ``#`` (a socket directory as host, a schema name with spaces) has
those characters written ``-`` and 8 hex digits of the name's hash added, so two such
names never share a slug; targets of one name (the same database and schema reached as
two users) get ``~2``, ``~3`` in the order given.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from .._pg import configuration_error, unmigrated, unreachable
from ..errors import ConfigurationError, OutboxError
from ..migrate import require_current
from ..targets import Target

TargetsSource = Iterable[Target] | Callable[[], Iterable[Target]]
"""What ``create_app(targets=...)`` takes: the targets, or a function returning them."""

PROBE_TIMEOUT = 5  # seconds to connect when a target is first shown, or again after failing

_UNSAFE = re.compile(r"[^A-Za-z0-9._@:-]")


def slug_of(target: Target) -> str:
    """The URL segment under which ``create_app(targets=...)`` serves ``target``
    (``/t/<slug>/``; ``outbox.web.target_slug``): its name with ``#`` written ``~``, or,
    when the name holds characters a path segment must not, those replaced and a hash
    of the whole name added, so the slug never carries a password and stays stable as
    the list of targets changes (see the module's docstring)."""
    database, schema = target.database, target.schema
    if not _UNSAFE.search(database) and not _UNSAFE.search(schema):
        return f"{database}~{schema}"
    digest = hashlib.sha256(target.name.encode()).hexdigest()[:8]
    return f"{_UNSAFE.sub('-', database)}~{_UNSAFE.sub('-', schema)}-{digest}"


def slugs(targets: list[Target]) -> list[str]:
    """Each target's slug (``target_slug``), in order; a repeated name gets ``~2``,
    ``~3`` after the first (``outbox.web.target_slugs``)."""
    seen: dict[str, int] = {}
    found = []
    for target in targets:
        slug = slug_of(target)
        seen[slug] = seen.get(slug, 0) + 1
        found.append(slug if seen[slug] == 1 else f"{slug}~{seen[slug]}")
    return found


def checked_targets(given: Any) -> list[Target]:
    """``given`` as a list of targets, each once, or ConfigurationError."""
    if isinstance(given, str | bytes) or not isinstance(given, Iterable):
        raise ConfigurationError(
            "targets must be a list of outbox.Target (or a function returning one), "
            f"got {type(given).__name__}")
    found: dict[Target, None] = {}
    for target in given:
        if not isinstance(target, Target):
            raise ConfigurationError(
                f"targets must hold outbox.Target values, got {type(target).__name__}")
        found[target] = None
    return list(found)


def check(target: Target) -> None:
    """Connect to the target and check its schema is migrated to this code's version:
    raises psycopg.Error, SchemaError or ConfigurationError when it cannot be shown."""
    with psycopg.connect(target.dsn, autocommit=True, connect_timeout=PROBE_TIMEOUT) as conn:
        require_current(conn, target.schema)


def is_connection_failure(exc: BaseException) -> bool:
    """Whether ``exc`` says the database itself is out of reach (not one schema)."""
    return (isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError)
            and not isinstance(exc, psycopg.errors.QueryCanceled)
            and unmigrated(exc, "") is None)


def failure_reason(exc: BaseException, target: Target) -> str | None:
    """Why ``target`` cannot be shown, in one line without its password; None when
    ``exc`` is no such failure (a fault of the dashboard's, left to raise)."""
    if isinstance(exc, OutboxError):  # SchemaError, ConfigurationError: their own words
        text = str(exc).strip()
        reason = text.splitlines()[0] if text else type(exc).__name__
    elif isinstance(exc, psycopg.Error):
        found = (unmigrated(exc, target.schema)
                 or configuration_error(exc, target.dsn, doing="read it"))
        if found is not None:
            reason = str(found)
        elif is_connection_failure(exc):
            reason = f"unreachable: {unreachable(exc, target.dsn)}"
        else:
            return None
    else:
        return None
    return without_secrets(reason, target.dsn)


def without_secrets(text: str, dsn: str) -> str:
    """``text`` with the connection string and its password, if it held them, removed."""
    text = text.replace(dsn, "(the connection string)")
    try:
        password = conninfo_to_dict(dsn).get("password")
    except psycopg.Error:
        password = None
    return text.replace(str(password), "***") if password else text
