"""``outbox schedules``: list the schedules (``outbox.Schedule``) with their state, and
add, pause, resume and remove them at run time, without a redeploy. Every change is
audited in ``dashboard_audit`` as the other operator actions are; running dispatchers
pick a change up within a second.

A schedule declared in a dispatcher's code wins over a stored one of the same name: it
cannot be added or removed here (pause and resume it instead).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import click
from psycopg.rows import dict_row

from . import _schedule_store, _sql
from ._steps import Step, execute, run
from .cli import VIA, _actor, _connect, _one_line_errors, actor_option, dsn_option, schema_option
from .errors import ConfigurationError
from .migrate import require_current
from .registry import did_you_mean
from .schedules import CATCH_UP, Schedule

__all__ = ["command"]


def _run(dsn: str, schema: str, step: Step[Any]) -> Any:
    """Run ``step`` in one transaction on a new connection."""
    with _connect(dsn) as conn:
        require_current(conn, schema)
        with conn.transaction():
            return run(step, lambda statement: execute(conn, statement))


def _at(value: datetime | None) -> str:
    return "-" if value is None else value.astimezone().isoformat(timespec="seconds")


@click.group("schedules", invoke_without_command=True)
@click.option("--dsn", envvar="OUTBOX_DATABASE_URL", default=None, metavar="DSN",
              help="PostgreSQL connection string (default: $OUTBOX_DATABASE_URL); also "
              "the subcommand's.")
@schema_option
@click.option("--json", "as_json", is_flag=True, help="Bare: print JSON instead of lines.")
@click.pass_context
@_one_line_errors
def command(ctx: click.Context, dsn: str | None, schema: str, as_json: bool) -> None:
    """The schedules: bare (or `list`) lists them; add, pause, resume, remove."""
    given = {"schema": schema, **({"dsn": dsn} if dsn is not None else {})}
    ctx.default_map = {name: dict(given) for name in ("list", "add", "pause", "resume",
                                                      "remove")}
    if ctx.invoked_subcommand is None:
        if dsn is None:
            raise click.UsageError("give --dsn (or $OUTBOX_DATABASE_URL)")
        ctx.invoke(list_command, dsn=dsn, schema=schema, as_json=as_json)


@command.command("list")
@dsn_option
@schema_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@_one_line_errors
def list_command(dsn: str, schema: str, as_json: bool) -> None:
    """Each schedule: its effect, when it fires, where it is defined (code or stored),
    paused or not, the next slot due, the last slot enqueued and its job's status."""
    listed: list[_schedule_store.Listed] = _run(dsn, schema, _schedule_store.listing(schema))
    if as_json:
        click.echo(json.dumps([
            {"name": s.name, "effect": s.effect, "when": s.when, "source": s.source,
             "paused": s.paused, "next_slot": s.next_slot.isoformat(),
             "last_slot": None if s.last_slot is None else s.last_slot.isoformat(),
             "last_job_id": s.last_job_id, "last_status": s.last_status,
             "last_error": s.last_error} for s in listed], indent=2))
        return
    if not listed:
        click.echo("no schedules")
        return
    for s in listed:
        state = "paused" if s.paused else f"next {_at(s.next_slot)}"
        last = ("never enqueued" if s.last_slot is None else
                f"last {_at(s.last_slot)} (job {s.last_job_id}: {s.last_status or 'gone'})")
        click.echo(f"{s.name}: {s.effect}, {s.when} [{s.source}]; {state}; {last}"
                   + (f"; error: {s.last_error}" if s.last_error else ""))


@command.command("add")
@dsn_option
@schema_option
@click.argument("name")
@click.option("--effect", required=True, help="The effect each slot's job performs.")
@click.option("--cron", default=None, metavar="EXPR", help="Five-field cron expression.")
@click.option("--every", default=None, type=float, metavar="SECONDS",
              help="Instead of --cron: a slot every SECONDS, aligned to the epoch.")
@click.option("--payload", default="{}", metavar="JSON", help="The jobs' payload (JSON object).")
@click.option("--timezone", default="UTC", show_default=True,
              help="IANA time zone the cron expression is read in.")
@click.option("--catch-up", default="latest", show_default=True, type=click.Choice(CATCH_UP),
              help="Slots missed while no dispatcher ran: the latest, all (bounded), or none.")
@click.option("--group", default=None, help="The jobs' group (tenant).")
@click.option("--priority", default=0, show_default=True, type=int, help="The jobs' priority.")
@actor_option
@_one_line_errors
def add_command(dsn: str, schema: str, name: str, effect: str, cron: str | None,
                every: float | None, payload: str, timezone: str, catch_up: str,
                group: str | None, priority: int, actor: str | None) -> None:
    """Store a schedule in the database (or change a stored one); running dispatchers
    pick it up within a second. Audited."""
    try:
        data = json.loads(payload)
    except ValueError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--payload") from None
    if not isinstance(data, dict):
        raise click.BadParameter("must be a JSON object", param_hint="--payload")
    try:
        schedule = Schedule(name, effect=effect, cron=cron, every=every, payload=data,
                            timezone=timezone, catch_up=catch_up, group=group,
                            priority=priority)
    except ConfigurationError as exc:
        raise click.UsageError(str(exc)) from None
    _warn_if_unserved(dsn, schema, effect)
    outcome = _run(dsn, schema, _schedule_store.store(schedule, schema, _actor(actor), VIA))
    if outcome == "code":
        raise click.ClickException(
            f"schedule {name!r} is declared in a dispatcher's code, which wins: change it "
            "there (or pause it with outbox schedules pause)")
    click.echo(f"schedule {name} {outcome}: {schedule.describe()}, effect {effect}")


def _warn_if_unserved(dsn: str, schema: str, effect: str) -> None:
    """Warn (stderr) when nothing names ``effect``: no dispatcher serves it, no job or
    limit names it (a typo?). Not refused: its dispatchers may be deployed later."""
    with _connect(dsn) as conn:
        require_current(conn, schema)
        found = conn.cursor(row_factory=dict_row).execute(
            _sql.queries(schema).effect_named, {"effect": effect}).fetchone()
    if found is not None and not found["named"]:
        known = ", ".join(found["known"]) or "none"
        click.echo(f"warning: no dispatcher serves effect {effect!r} (effects dispatchers "
                   f"serve: {known}){did_you_mean(effect, found['known'])}: the "
                   f"schedule's jobs wait until one does", err=True)


@command.command("pause")
@dsn_option
@schema_option
@click.argument("name")
@actor_option
@_one_line_errors
def pause_command(dsn: str, schema: str, name: str, actor: str | None) -> None:
    """Pause a schedule (code or stored): no slot is enqueued until it is resumed.
    Audited."""
    _pause(dsn, schema, name, True, actor)


@command.command("resume")
@dsn_option
@schema_option
@click.argument("name")
@actor_option
@_one_line_errors
def resume_command(dsn: str, schema: str, name: str, actor: str | None) -> None:
    """Resume a paused schedule from its next slot (the slots of the pause are not
    caught up). Audited."""
    _pause(dsn, schema, name, False, actor)


def _pause(dsn: str, schema: str, name: str, paused: bool, actor: str | None) -> None:
    changed = _run(dsn, schema, _schedule_store.set_paused(name, paused, schema,
                                                           _actor(actor), VIA))
    if changed is None:
        raise click.ClickException(f"no schedule {name!r} in schema {schema!r}")
    verb = "paused" if paused else "resumed"
    click.echo(f"schedule {name} {verb}" if changed else f"schedule {name} was already {verb}")


@command.command("remove")
@dsn_option
@schema_option
@click.argument("name")
@actor_option
@_one_line_errors
def remove_command(dsn: str, schema: str, name: str, actor: str | None) -> None:
    """Remove a stored schedule (its jobs stay). Audited."""
    outcome = _run(dsn, schema, _schedule_store.remove(name, schema, _actor(actor), VIA))
    if outcome == "missing":
        raise click.ClickException(f"no schedule {name!r} in schema {schema!r}")
    if outcome == "code":
        raise click.ClickException(
            f"schedule {name!r} is declared in a dispatcher's code and would come back when "
            "one starts: remove it there, or pause it (outbox schedules pause)")
    click.echo(f"schedule {name} removed")
