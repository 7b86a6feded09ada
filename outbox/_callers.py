"""Callers that are not Python: the SQL ``<schema>.enqueue`` function (migration 0017),
the mapping of its errors back to the outbox error tree, and the trigger that ``outbox
trigger-sql`` prints.

The function itself lives in the migration; what is here is pure (no I/O): the SQLSTATEs
it raises and what each means, and the text of a trigger that calls it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import click
from psycopg import sql

from ._sql import MAX_IDENTIFIER_BYTES, check_schema_name
from .errors import (
    EnqueueError,
    IdempotencyKeyConflict,
    InvalidArgument,
    InvalidKey,
    InvalidPayload,
    OutboxError,
    UnknownEffect,
)

__all__ = ["SQLSTATES", "TriggerSpec", "command", "enqueue_error", "trigger_sql"]

SQLSTATES: dict[str, type[EnqueueError]] = {
    "OB409": IdempotencyKeyConflict,
    "OB422": InvalidPayload,
    "OB400": InvalidKey,
    "OB404": UnknownEffect,
    "22023": InvalidArgument,
}
"""What ``<schema>.enqueue`` raises, by SQLSTATE: the error ``tx.enqueue`` raises for it."""

_KEY_DETAIL = "key: "


def enqueue_error(sqlstate: str | None, message: str, detail: str | None = None,
                  ) -> EnqueueError | None:
    """The outbox error for an error ``<schema>.enqueue`` raised (``sqlstate``, its
    primary message and its detail, as ``psycopg.Error.diag`` holds them), or None when
    the error is not one of its refusals (a lost connection, a lock timeout)."""
    kind = SQLSTATES.get(sqlstate or "")
    if kind is None:
        return None
    if kind is IdempotencyKeyConflict:
        key = (detail or "").removeprefix(_KEY_DETAIL)
        error = IdempotencyKeyConflict(key, "")
        error.args = (message,)
        return error
    return kind(message)


@dataclass(frozen=True)
class TriggerSpec:
    """A trigger that enqueues ``effect`` for each row of ``table`` inserted or updated.

    ``key`` and ``payload`` are SQL expressions over ``NEW`` (the row), e.g.
    ``'email-order-' || NEW.id`` and ``jsonb_build_object('order', NEW.id)``.
    """

    table: str
    effect: str
    key: str
    payload: str = "to_jsonb(NEW)"
    schema: str = "outbox"
    events: tuple[str, ...] = ("INSERT", "UPDATE")
    when: str | None = None
    name: str | None = None


_EVENTS = ("INSERT", "UPDATE")
_DOLLAR_TAG = "$outbox_enqueue$"


def _qualified(table: str) -> tuple[str | None, str]:
    """``[schema.]table`` split at its first dot (names with a dot are not supported)."""
    namespace, dot, name = table.partition(".")
    if not dot:
        return None, table
    return namespace, name


def _default_name(table: str, effect: str) -> str:
    name = f"{table}_outbox_{re.sub(r'[^A-Za-z0-9_]+', '_', effect)}"
    return name.encode()[:MAX_IDENTIFIER_BYTES].decode(errors="ignore")


def _check(spec: TriggerSpec) -> None:
    check_schema_name(spec.schema)
    namespace, table = _qualified(spec.table)
    for what, value in (("table", table), ("table's schema", namespace), ("name", spec.name)):
        if value is not None and (not value or len(value.encode()) > MAX_IDENTIFIER_BYTES):
            raise InvalidArgument(f"{what} {value!r} is not a PostgreSQL identifier "
                                  f"(1 to {MAX_IDENTIFIER_BYTES} bytes)")
    if not spec.effect.strip():
        raise InvalidArgument("effect must be a non-empty effect name, e.g. 'email.send'")
    for what, expression in (("key", spec.key), ("payload", spec.payload),
                             ("when", spec.when or "true")):
        if not expression.strip():
            raise InvalidArgument(f"the {what} expression must not be empty")
        if _DOLLAR_TAG in expression:
            raise InvalidArgument(f"the {what} expression must not contain {_DOLLAR_TAG}")
    unknown = [event for event in spec.events if event not in _EVENTS]
    if unknown or not spec.events:
        raise InvalidArgument(f"events must be INSERT and/or UPDATE, got {spec.events!r}")


def trigger_sql(spec: TriggerSpec) -> str:
    """The SQL that creates (or replaces) the trigger function and the trigger: after
    each row of ``spec.table`` is inserted or updated, ``<schema>.enqueue(effect, key,
    payload)`` in the writer's transaction, so the job commits if and only if the row
    does. Identifiers are quoted; ``key``, ``payload`` and ``when`` are SQL expressions
    put in as given (they are the caller's SQL, like a view's)."""
    _check(spec)
    namespace, table = _qualified(spec.table)
    name = spec.name or _default_name(table, spec.effect)
    target = (sql.SQL("{}.{}").format(sql.Identifier(namespace), sql.Identifier(table))
              if namespace else sql.Identifier(table))
    function = (sql.SQL("{}.{}").format(sql.Identifier(namespace), sql.Identifier(name))
                if namespace else sql.Identifier(name))
    when = f"\n    WHEN ({spec.when})" if spec.when else ""
    values = {
        "function": function.as_string(None),
        "trigger": sql.Identifier(name).as_string(None),
        "table": target.as_string(None),
        "enqueue": sql.SQL("{}.enqueue").format(sql.Identifier(spec.schema)).as_string(None),
        "effect": sql.Literal(spec.effect).as_string(None),
        "events": " OR ".join(spec.events),
    }
    return f"""\
-- Enqueue {spec.effect!r} for each row of {values['table']} inserted or updated, in the
-- writer's transaction: the job commits if and only if the row does. A key already known
-- with the same payload makes no second job; with another payload the write fails
-- (SQLSTATE OB409): a key for updates should name the change (a version, a status).
CREATE OR REPLACE FUNCTION {values['function']}() RETURNS trigger
LANGUAGE plpgsql AS {_DOLLAR_TAG}
BEGIN
    PERFORM {values['enqueue']}(
        {values['effect']},
        {spec.key},
        {spec.payload});
    RETURN NULL;
END
{_DOLLAR_TAG};

DROP TRIGGER IF EXISTS {values['trigger']} ON {values['table']};
CREATE TRIGGER {values['trigger']}
    AFTER {values['events']} ON {values['table']}
    FOR EACH ROW{when}
    EXECUTE FUNCTION {values['function']}();
"""


@click.command("trigger-sql")
@click.option("--table", required=True, metavar="[SCHEMA.]TABLE",
              help="The table whose inserted or updated rows enqueue a job.")
@click.option("--effect", required=True, help="The effect to enqueue, e.g. email.send.")
@click.option("--key", "key", required=True, metavar="SQL",
              help="The idempotency key, an SQL expression over NEW, e.g. "
                   "\"'email-order-' || NEW.id\".")
@click.option("--payload", default="to_jsonb(NEW)", show_default=True, metavar="SQL",
              help="The payload, an SQL expression over NEW giving a jsonb object.")
@click.option("--schema", default="outbox", show_default=True, envvar="OUTBOX_SCHEMA",
              help="Schema holding the outbox tables.")
@click.option("--on", "on", type=click.Choice(["insert", "update", "insert-or-update"]),
              default="insert-or-update", show_default=True,
              help="Which writes enqueue.")
@click.option("--when", default=None, metavar="SQL",
              help="Only rows for which this SQL condition holds (e.g. "
                   "\"NEW.status = 'paid'\").")
@click.option("--name", default=None,
              help="Name of the trigger and its function (default: TABLE_outbox_EFFECT).")
def command(table: str, effect: str, key: str, payload: str, schema: str, on: str,
            when: str | None, name: str | None) -> None:
    """Print the SQL of a trigger that enqueues EFFECT with key KEY when a row of TABLE is
    inserted or updated (run it with psql; it changes nothing by itself)."""
    events = ("INSERT", "UPDATE") if on == "insert-or-update" else (on.upper(),)
    try:
        text = trigger_sql(TriggerSpec(table=table, effect=effect, key=key, payload=payload,
                                       schema=schema, events=events, when=when, name=name))
    except (OutboxError, ValueError) as exc:
        raise click.UsageError(str(exc)) from None
    click.echo(text, nl=False)
