"""The dashboard as an ASGI application: overview, job list and detail, fenced actions.

``create_app`` returns a Starlette application that can run on its own (``outbox web``)
or be mounted in a host application (``Mount("/outbox", create_app(...))``). It opens its
connection pool on first use, so a mounted app needs no lifespan events. With
``targets=[Target, ...]`` one app shows several outboxes, each under ``/t/<slug>/``.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import InitVar, dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import jinja2
import psycopg
from psycopg import errors as pg_errors
from psycopg.rows import AsyncRowFactory, class_row, dict_row, namedtuple_row
from psycopg.types.datetime import TimestamptzLoader
from psycopg_pool import AsyncConnectionPool
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route, Router
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates
from starlette.types import Message, Receive, Scope, Send

from .. import _queue
from .._enqueue import notify_channel
from .._sql import check_schema_name
from .._sql import queries as core_queries
from ..errors import ConfigurationError
from ..targets import Target
from ._filters import STATUSES, FilterError, JobFilter
from ._queries import (
    CappedCount,
    FailedGroup,
    Flow,
    Followup,
    Holder,
    JobAudit,
    LedgerRow,
    Listed,
    RecentAudit,
    Reconciled,
    Related,
    SeenEffect,
    Settled,
    WebQueries,
    Writable,
    web_queries,
)
from ._security import (
    CSRF_COOKIE,
    CSRF_FIELD,
    SECURITY_HEADERS,
    Access,
    Authorizer,
    BasicAuth,
    access_of,
    actor_of,
    cross_site_reason,
    new_token,
    token_matches,
)
from ._targets import (
    PROBE_TIMEOUT,
    TargetsSource,
    checked_targets,
    failure_reason,
    is_connection_failure,
    slugs,
)
from ._targets import check as check_target
from ._unserved import unserved as unserved_effects
from ._views import Redactor, age, ago, minute_chart, seconds_text, shown_payload, timestamp
from ._views import truncate_payload as default_redact

log = logging.getLogger("outbox.web")

R = TypeVar("R")

HERE = Path(__file__).parent
PAGE_SIZE = 50
COUNT_CAP = 10_000
FINISHED = ("done", "failed", "reconcile")  # listed most recently finished first
RELATED_SHOWN = 200  # a job's parents and children (fan-in) shown on its page, at most
BULK_CAP = 1_000
STATEMENT_TIMEOUT = "5s"
# Fixed messages for the outcome of an action: the page never reflects request text.
OUTCOMES = {
    "retried": "Job sent back to pending.",
    "cancelled": "Job cancelled: it will not be performed.",
    "told": "Its perform is told to stop; the job ends failed (or in reconcile) unless it "
            "finished first.",
    "resolved_done": "Recorded as performed at the provider.",
    "resolved_failed": "Recorded as not performed; the job is failed.",
    "moved": "The job moved on before your action: nothing was changed. Review it again.",
}


@dataclass
class Database:
    """A connection pool on one database, opened on first use (mounted apps get no
    lifespan events); a dashboard over several outboxes shares one between the targets
    (schemas) of a database."""

    conninfo: str
    min_size: int = 1
    max_size: int = 4
    timeout: float = 30.0
    max_idle: float = 600.0
    kwargs: dict[str, Any] | None = None
    pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]] | None = None
    lock: asyncio.Lock | None = None

    async def get_pool(self) -> AsyncConnectionPool[psycopg.AsyncConnection[Any]]:
        """The pool, opened on first use; its connections read any timestamp a job can
        hold (``_EdgeTimestamptzLoader``)."""
        if self.pool is None:
            self.lock = self.lock or asyncio.Lock()
            async with self.lock:
                if self.pool is None:
                    pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]] = (
                        AsyncConnectionPool(self.conninfo, min_size=self.min_size,
                                            max_size=self.max_size, timeout=self.timeout,
                                            max_idle=self.max_idle, kwargs=self.kwargs,
                                            configure=_read_every_timestamp,
                                            open=False, name="outbox-web"))
                    await pool.open()
                    self.pool = pool
        return self.pool

    async def close(self) -> None:
        """Close the pool, if it was opened."""
        if self.pool is not None:
            pool, self.pool = self.pool, None
            await pool.close()


class _EdgeTimestamptzLoader(TimestamptzLoader):
    """timestamptz as psycopg reads it, except the values Python's ``datetime`` cannot
    hold and PostgreSQL stores: ``infinity``, the years past 9999 and before 1 (a job
    written by SQL, ``run_at => 'infinity'``, or by hand). Read as the datetime at that end
    of Python's calendar, so that one such row does not make every page listing it
    answer 500; the page shows the calendar's end, the row is left as it is."""

    def load(self, data: Any) -> datetime:
        try:
            return super().load(data)
        except psycopg.DataError:
            text = bytes(data)
            before = text.startswith(b"-") or text.endswith(b" BC")
            return (datetime.min if before else datetime.max).replace(tzinfo=UTC)


async def _read_every_timestamp(conn: psycopg.AsyncConnection[Any]) -> None:
    conn.adapters.register_loader("timestamptz", _EdgeTimestamptzLoader)


@dataclass
class Settings:
    """One outbox's configuration and the pool of its database, opened on first use."""

    conninfo: str
    schema: str
    read_only: bool
    authorize: Authorizer | None
    redact: Redactor
    queries: WebQueries
    channel: str
    shared: InitVar[Database | None] = None
    database: Database = field(init=False)
    # Several outboxes: found reachable and migrated (else checked before it is shown).
    checked: bool = False

    def __post_init__(self, shared: Database | None) -> None:
        self.database = shared or Database(self.conninfo)

    async def get_pool(self) -> AsyncConnectionPool[psycopg.AsyncConnection[Any]]:
        """The pool, opened on first use (mounted apps get no lifespan events)."""
        return await self.database.get_pool()

    async def close(self) -> None:
        """Close the pool, if it was opened."""
        await self.database.close()


class Denied(Exception):
    """A request refused before any work; carries the response to send."""

    def __init__(self, response: Response) -> None:
        self.response = response


def _templates() -> Jinja2Templates:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,  # everything, whatever the template's file name
        undefined=jinja2.StrictUndefined,
    )
    env.filters.update(age=age, ago=ago, ts=timestamp, seconds=seconds_text)
    return Jinja2Templates(env=env)


TEMPLATES = _templates()


def settings_of(request: Request) -> Settings:
    """The settings of the outbox ``request`` is about: the app's, or those of the
    target its URL chose (``/t/<slug>/...``)."""
    chosen: Settings | None = request.scope.get(SETTINGS_KEY)
    if chosen is not None:
        return chosen
    settings: Settings = request.app.state.outbox
    return settings


def board_of(request: Request) -> Board | None:
    """The targets of a dashboard over several outboxes; None for a single outbox."""
    state = request.app.state.outbox
    return state if isinstance(state, Board) else None


@asynccontextmanager
async def transaction(settings: Settings) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """A pooled connection in a transaction bounded by the statement timeout."""
    pool = await settings.get_pool()
    async with pool.connection() as conn, conn.transaction():
        # Custom plans fold the optional filters' NULL tests away; the timeout keeps a
        # broad filter on a large table from holding a connection.
        await conn.execute(
            "SELECT set_config('statement_timeout', %(t)s, true), "
            "set_config('plan_cache_mode', 'force_custom_plan', true)",
            {"t": STATEMENT_TIMEOUT})
        yield conn


async def rows(conn: psycopg.AsyncConnection[Any], query: str,
               params: Mapping[str, Any] | None = None) -> list[tuple[Any, ...]]:
    """Every row of ``query``, as tuples: for statements run for their effect."""
    cur = await conn.execute(query, params or {})
    return await cur.fetchall()


async def fetch(conn: psycopg.AsyncConnection[Any], query: str, row: AsyncRowFactory[R],
                params: Mapping[str, Any] | None = None) -> list[R]:
    """Every row of ``query``, made by ``row`` (``class_row(Record)``, ``dict_row``)."""
    cur = conn.cursor(row_factory=row)
    await cur.execute(query, params or {})
    return await cur.fetchall()


async def records(conn: psycopg.AsyncConnection[Any], query: str, record: type[R],
                  params: Mapping[str, Any] | None = None) -> list[R]:
    """Every row of ``query`` as a ``record``, its fields filled by column name."""
    return await fetch(conn, query, class_row(record), params)


async def writable(settings: Settings, conn: psycopg.AsyncConnection[Any]) -> bool:
    """Whether actions are possible: not read-only by flag, transaction or privilege."""
    if settings.read_only:
        return False
    q = settings.queries
    [found] = await records(conn, q.writable, Writable, {"jobs_table": q.jobs_table,
                                                         "audit_table": q.audit_table})
    return found.writable


async def authorized(request: Request, needed: Access) -> Access:
    """The caller's access, or Denied (401 with a challenge, or 403)."""
    authorize = (board_of(request) or settings_of(request)).authorize
    granted = await access_of(authorize, request)
    if granted is None:
        if isinstance(authorize, BasicAuth):
            raise Denied(PlainTextResponse(
                "authentication required", status_code=401,
                headers={"www-authenticate": authorize.challenge}))
        raise Denied(PlainTextResponse("forbidden", status_code=403))
    if needed == "operate" and granted != "operate":
        raise Denied(PlainTextResponse("read-only access: actions are not allowed", 403))
    return granted


def render(request: Request, name: str, context: dict[str, Any],
           status_code: int = 200) -> Response:
    """A template with the common context, a CSRF cookie, and the security headers."""
    token = request.cookies.get(CSRF_COOKIE) or new_token()
    # base: where this outbox's pages are; root: the dashboard's own (static files, the
    # targets); the same but under /t/<slug> when a target is chosen.
    base = request.scope.get("root_path", "")
    root = request.scope.get(ROOT_KEY, base)
    context = {"base": base, "root": root, "csrf_field": CSRF_FIELD, "csrf": token,
               "statuses": STATUSES, **_targets_context(request, base), **context}
    response = TEMPLATES.TemplateResponse(request, name, context, status_code=status_code)
    if request.cookies.get(CSRF_COOKIE) != token:
        response.set_cookie(CSRF_COOKIE, token, httponly=True, samesite="strict",
                            path=root or "/")
    return response


def _targets_context(request: Request, base: str) -> dict[str, Any]:
    """The header's target picker: shown when the dashboard has several targets."""
    board = board_of(request)
    chosen: Target | None = request.scope.get(TARGET_KEY)
    picker = None
    back: dict[str, str] = {}
    if board is not None and len(board.entries) > 1:
        picker = [{"slug": e.slug, "name": e.target.name, "selected": e.target == chosen}
                  for e in board.entries]
        # Switching targets from a job list opens the same list of the other target.
        if chosen is not None and request.scope["path"] == f"{base}/jobs":
            back["page"] = "jobs"
            if request.query_params.get("status") in STATUSES:
                back["status"] = request.query_params["status"]
    return {"multi": board is not None, "picker": picker, "picker_return": back,
            "current_target": None if chosen is None else chosen.name}


async def overview(request: Request) -> Response:
    """Counts, backlog age, the last hour's throughput and failures, dispatchers."""
    access = await authorized(request, "read")
    settings = settings_of(request)
    q = settings.queries
    since = (datetime.now(UTC) - timedelta(minutes=59)).replace(second=0, microsecond=0)
    async with transaction(settings) as conn:
        snapshot = await _queue.read_async(conn, settings.schema)
        groups = await _queue.on_async(conn, _queue.busiest_groups(
            settings.schema, _queue.BUSIEST_GROUPS, snapshot.sampled_groups))
        settled = await records(conn, q.settled_per_minute, Settled, {"since": since})
        dispatchers = await records(conn, q.dispatchers, Holder)
        audit = await records(conn, q.recent_audit, RecentAudit, {"limit": 10})
        can_act = access == "operate" and await writable(settings, conn)
        core = core_queries(settings.schema)
        # Named, and indexable where the pause cells still read by position.
        limits = await fetch(conn, core.limits_overview, namedtuple_row)
        shared = await fetch(conn, core.shared_overview, namedtuple_row)
        failed_groups = await records(conn, core.failed_groups, FailedGroup, {"limit": 20})
        unserved = await unserved_effects(conn, settings.schema)
    health = snapshot.health
    return render(request, "overview.html", {
        "limits": limits,
        "shared": shared,  # when this schema is a limits home (Limit(shared=True))
        # Only effects whose jobs name groups: a table of "(no group)" alone says nothing.
        "groups": {effect: found for effect, found in groups.items()
                   if any(g.group_key is not None for g in found)},
        "top_groups": _queue.BUSIEST_GROUPS,
        "failed_groups": [replace(g, search=error_search(g.sample)) for g in failed_groups],
        "counts": snapshot.counts, "effects": sorted(snapshot.effects()), "health": health,
        "chart": minute_chart(settled, since),
        "dispatchers": dispatchers, "audit": audit, "can_act": can_act,
        "unserved": unserved,  # effects with due jobs no running dispatcher handles
        "oldest_due": max((h.oldest_due_age for h in health.values()
                           if h.oldest_due_age is not None), default=None),
    })


async def job_list(request: Request) -> Response:
    """Jobs matching the filter, newest first, a keyset page at a time."""
    access = await authorized(request, "read")
    settings = settings_of(request)
    q = settings.queries
    try:
        job_filter = JobFilter.from_query(request.query_params)
        before = _int_param(request.query_params.get("before"), "before")
        before_at = _time_param(request.query_params.get("before_at"), "before_at")
    except FilterError as exc:
        return render(request, "error.html", {"message": str(exc)}, status_code=400)
    # A status of finished jobs is paged in its own index, most recently finished first.
    finished = job_filter.status in FINISHED
    params = {**job_filter.params(), "before": before, "limit": PAGE_SIZE + 1,
              "before_at": before_at if finished and before is not None else None}
    try:
        async with transaction(settings) as conn:
            page = await records(conn, q.job_page_finished if finished else q.job_page,
                                 Listed, params)
            total = None if before else (await records(
                conn, q.job_count, CappedCount,
                {**job_filter.params(), "cap": COUNT_CAP + 1}))[0].jobs
            effects = [seen.effect for seen in await records(
                conn, q.effects_seen, SeenEffect, {"schema_name": settings.schema})]
            can_act = access == "operate" and await writable(settings, conn)
    except pg_errors.QueryCanceled:
        return render(request, "error.html", {"message": (
            f"The search took longer than {STATEMENT_TIMEOUT} and was stopped. "
            "Narrow the filter (a status, an effect or a key prefix).")}, status_code=503)
    more = len(page) > PAGE_SIZE
    page = page[:PAGE_SIZE]
    template = "_rows.html" if request.headers.get("hx-request") and before else "jobs.html"
    return render(request, template, {
        "jobs": page, "filter": job_filter, "query": job_filter.query(), "total": total,
        "count_cap": COUNT_CAP, "next_before": page[-1].id if more else None,
        "next_before_at": page[-1].updated_at.isoformat() if more and finished else None,
        "effects": effects, "can_act": can_act, "bulk_cap": BULK_CAP, "message": None,
    })


def _time_param(value: str | None, name: str) -> datetime | None:
    if value is None or value == "":
        return None
    try:
        found = datetime.fromisoformat(value)
    except ValueError:
        raise FilterError(f"{name}: {value[:40]!r} is not a time") from None
    return found if found.tzinfo is not None else found.replace(tzinfo=UTC)


def _int_param(value: str | None, name: str) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise FilterError(f"{name}: {value[:40]!r} is not a whole number") from None


async def job_detail(request: Request) -> Response:
    """One job: state, attempts, lease, last error, ledger row, redacted payload, audit."""
    access = await authorized(request, "read")
    settings = settings_of(request)
    q = settings.queries
    job_id = request.path_params["job_id"]
    async with transaction(settings) as conn:
        found = await fetch(conn, q.job_detail, dict_row, {"id": job_id})
        if not found:
            return render(request, "error.html", {"message": f"No job {job_id}."}, 404)
        job = _job_dict(found[0], settings)
        ledger = await records(conn, q.job_ledger, LedgerRow, {"key": job["key"]})
        audit = await records(conn, q.job_audit, JobAudit, {"id": job_id})
        flow = await job_flow(conn, q, job_id, job["key"])
        can_act = access == "operate" and await writable(settings, conn)
    outcome = OUTCOMES.get(request.query_params.get("outcome", ""))
    return render(request, "job.html", {
        **flow,
        "job": job, "ledger": ledger[0] if ledger else None, "audit": audit,
        "can_act": can_act, "message": outcome,
        "moved": request.query_params.get("outcome") == "moved",
    })


async def job_flow(conn: psycopg.AsyncConnection[Any], q: Any, job_id: int,
                   key: str) -> dict[str, Any]:
    """The job's place in its flow (parent, follow-ups) and its reconciliation."""
    flow = await records(conn, q.job_flow, Flow, {"id": job_id})
    return {
        "flow": flow[0] if flow else None,
        "followups": await records(conn, q.job_followups, Followup, {"key": key}),
        "related": await records(conn, q.job_after, Related,
                                 {"id": job_id, "key": key, "limit": RELATED_SHOWN}),
        "reconciliation": await records(conn, q.job_reconciliation, Reconciled,
                                        {"id": job_id}),
    }


def _job_dict(row: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """The job detail's columns by name, the payload replaced by what may be shown."""
    job = dict(row)
    job["payload_shown"] = shown_payload(settings.redact, job["effect"], job.pop("payload"))
    return job


async def mutation_form(request: Request) -> tuple[dict[str, str], str]:
    """The form of an allowed mutation and the actor, or Denied."""
    await authorized(request, "operate")
    reason = cross_site_reason(request)
    form = {k: v for k, v in (await request.form()).items() if isinstance(v, str)}
    if reason is None or (reason == "" and token_matches(request, form.get(CSRF_FIELD))):
        settings = settings_of(request)
        if settings.read_only:
            raise Denied(PlainTextResponse("the dashboard is read-only", 403))
        return form, actor_of(settings.authorize, request)
    log.warning("refused a cross-site dashboard request: %s", reason or "no CSRF token")
    raise Denied(PlainTextResponse("cross-site request refused", status_code=403))


# Each action is the queue model's transition: the same statement as `outbox retry`'s.
ACTIONS: dict[str, tuple[Callable[..., Any], str]] = {
    "retry": (_queue.retry, "retried"),
    "cancel": (_queue.cancel, "cancelled"),
    "resolve_done": (functools.partial(_queue.resolve, performed=True), "resolved_done"),
    "resolve_failed": (functools.partial(_queue.resolve, performed=False), "resolved_failed"),
}
VIA = "dashboard"


async def job_action(request: Request) -> Response:
    """A fenced action on one job: changes it only if it is still as the operator saw it."""
    form, actor = await mutation_form(request)
    settings = settings_of(request)
    action = request.path_params["action"]
    if action not in ACTIONS:
        return PlainTextResponse(f"unknown action {action[:40]!r}", status_code=404)
    transition, done_outcome = ACTIONS[action]
    job_id = request.path_params["job_id"]
    try:
        seen_version = int(form.get("claim_version", ""))
    except ValueError:
        return PlainTextResponse("claim_version: a whole number is required", 400)
    seen = _queue.Seen(form.get("status") or None, seen_version)
    async with transaction(settings) as conn:
        if not await writable(settings, conn):
            return PlainTextResponse("the database is read-only for the dashboard", 403)
        done = await _queue.on_async(conn, transition(
            settings.schema, job_id, _queue.Operator(actor, VIA), seen=seen,
            note=form.get("note", "")[:1000]))
    outcome = done_outcome if done.changed else "moved"
    if outcome == "cancelled" and done.status == "running":  # its claim is asked to stop
        outcome = "told"
    if form.get("view") == "row":
        return await _row_after_action(request, job_id, outcome)
    base = request.scope.get("root_path", "")
    return RedirectResponse(f"{base}/jobs/{job_id}?outcome={outcome}", status_code=303)


async def _row_after_action(request: Request, job_id: int, outcome: str) -> Response:
    settings = settings_of(request)
    async with transaction(settings) as conn:
        found = await records(conn, settings.queries.job_page, Listed, {
            **JobFilter().params(), "before": job_id + 1, "limit": 1})
        can_act = await writable(settings, conn)
    job_rows = [listed for listed in found if listed.id == job_id]
    return render(request, "_rows.html", {
        "jobs": job_rows, "can_act": can_act, "message": OUTCOMES[outcome],
        "moved": outcome == "moved", "next_before": None, "query": {},
    })


async def bulk_retry(request: Request) -> Response:
    """Retry failed jobs matching a filter: first a confirmation page, then the action."""
    form, actor = await mutation_form(request)
    settings = settings_of(request)
    q = settings.queries
    try:
        job_filter = JobFilter.from_query({**form, "status": "failed"})
    except FilterError as exc:
        return render(request, "error.html", {"message": str(exc)}, status_code=400)
    async with transaction(settings) as conn:
        if not await writable(settings, conn):
            return PlainTextResponse("the database is read-only for the dashboard", 403)
        if form.get("confirm") != "yes":
            count = (await records(conn, q.job_count, CappedCount,
                                   {**job_filter.params(), "cap": BULK_CAP + 1}))[0].jobs
            return render(request, "confirm_bulk.html", {
                "filter": job_filter, "query": job_filter.query(), "count": count,
                "bulk_cap": BULK_CAP})
        changed = await _queue.on_async(conn, _queue.bulk_retry(
            settings.schema, _queue.Selection(**job_filter.params()),
            _queue.Operator(actor, VIA), cap=BULK_CAP, described=job_filter.describe()))
    return render(request, "bulk_done.html", {"changed": changed, "query": job_filter.query()})


def error_search(sample: str | None) -> str:
    """What to search failed jobs' errors for to find a group: its sample up to the
    first number or id (the part every job of the group shares)."""
    text = re.split(r"[0-9]", sample or "", maxsplit=1)[0]
    return text[:120].strip()


async def pause_form(request: Request, field: str,
                     required: str) -> tuple[dict[str, str], str, bool, str]:
    """The form of a pause / resume action: (form, actor, True to pause, the name in
    ``field``), or Denied: 404 for another action, 400 (``required``) without the name."""
    form, actor = await mutation_form(request)
    action = request.path_params["action"]
    if action not in ("pause", "resume"):
        raise Denied(PlainTextResponse(f"unknown action {action[:40]!r}", status_code=404))
    name = form.get(field, "").strip()
    if not name:
        raise Denied(PlainTextResponse(required, 400))
    return form, actor, action == "pause", name


async def effect_action(request: Request) -> Response:
    """Pause or resume an effect for every dispatcher (audited in the same statement)."""
    form, actor, pause, effect = await pause_form(
        request, "effect", "effect: the name of the effect is required")
    settings = settings_of(request)
    core = core_queries(settings.schema)
    minutes = form.get("minutes", "").strip()
    try:
        seconds = None if not minutes else float(minutes) * 60.0
    except ValueError:
        return PlainTextResponse("minutes: a number is required (or nothing: until resumed)",
                                 400)
    if seconds is not None and not 0 < seconds <= 365 * 86400:
        return PlainTextResponse("minutes: more than 0 and at most a year", 400)
    async with transaction(settings) as conn:
        if not await writable(settings, conn):
            return PlainTextResponse("the database is read-only for the dashboard", 403)
        if pause:
            await rows(conn, core.limit_pause, {"effect": effect, "seconds": seconds,
                                                 "actor": actor})
        else:
            await rows(conn, core.limit_resume, {"effect": effect, "actor": actor,
                                                  "channel": settings.channel})
    base = request.scope.get("root_path", "")
    return RedirectResponse(f"{base}/", status_code=303)


async def metrics(request: Request) -> Response:
    """The database-derived gauges, in the Prometheus text format."""
    await authorized(request, "read")
    # prometheus-client is an extra; the collector lives in the core, not in
    # outbox.metrics (which must not need the dashboard's extra, nor be needed by it).
    from .._database_metrics import render_database_metrics

    settings = settings_of(request)
    body, content_type = await asyncio.to_thread(
        render_database_metrics, settings.conninfo, settings.schema)
    return Response(body, media_type=content_type)


# -- several outboxes ---------------------------------------------------------------------
# create_app(targets=...) serves each target's pages under /t/<slug>/ (the slug: its name,
# see _targets.py); / lists the targets, /pick is the header's picker.

ROOT_KEY = "outbox.root"  # scope keys set under /t/<slug>/: the dashboard's own root path,
TARGET_KEY = "outbox.target"  # the chosen Target (an authorizer may read it),
SETTINGS_KEY = "outbox.settings"  # and its Settings
TARGETS_TTL = 5.0  # seconds a targets function's list is used before it is read again
TARGETS_AT_ONCE = 10  # targets the targets page reads at the same time


@dataclass
class Entry:
    """One target of a dashboard over several outboxes: its slug and settings."""

    slug: str
    target: Target
    settings: Settings

    async def ready(self) -> None:
        """Check, once, that the target is reachable and migrated; raises why not."""
        if not self.settings.checked:
            await asyncio.to_thread(check_target, self.target)
            self.settings.checked = True

    async def failed(self, exc: BaseException, reason: str) -> None:
        """Forget it was found ready: the next request checks again (and a database out
        of reach has its pool closed, so it starts afresh once back)."""
        log.warning("dashboard: target %s cannot be shown: %s", self.target.name, reason)
        self.settings.checked = False
        if is_connection_failure(exc):
            await self.settings.close()


@dataclass(frozen=True)
class TargetState:
    """A row of the targets page."""

    slug: str
    name: str
    up: bool
    due: int | None
    reason: str | None
    capped: bool = False  # a due count stopped at its cap: at least that many


class TargetsUnreadable(Exception):
    """The targets function failed before any list was read."""


class Board:
    """The outboxes a dashboard shows (``create_app(targets=...)``): the list, re-read
    from a function at most every TARGETS_TTL seconds, and each target's settings; the
    targets of one database share its pool."""

    def __init__(self, source: TargetsSource, *, read_only: bool,
                 authorize: Authorizer | None, redact: Redactor) -> None:
        self.source = source
        self.read_only = read_only
        self.authorize = authorize
        self.redact = redact
        self.entries: list[Entry] = []
        self.by_slug: dict[str, Entry] = {}
        self.databases: dict[str, Database] = {}
        self.read_at: float | None = None
        self.lock = asyncio.Lock()
        if not callable(source):
            self._install(checked_targets(source))
            self.read_at = math.inf  # a list given once is never read again

    async def current(self) -> list[Entry]:
        """The targets now: a function's list is read again once TARGETS_TTL old."""
        if self.read_at is not None and time.monotonic() - self.read_at < TARGETS_TTL:
            return self.entries
        async with self.lock:
            if self.read_at is not None and time.monotonic() - self.read_at < TARGETS_TTL:
                return self.entries
            assert callable(self.source)
            try:
                given = await asyncio.to_thread(self.source)
                if inspect.isawaitable(given):
                    given = await given
                targets = checked_targets(given)
            except Exception as exc:  # the application's function: say which, go on
                log.warning("dashboard: the targets function failed: %s", _describe(exc))
                if self.read_at is None:
                    raise TargetsUnreadable(type(exc).__name__) from exc
                self.read_at = time.monotonic()  # the last list, until the next try
                return self.entries
            closing = self._install(targets)
            self.read_at = time.monotonic()
        for database in closing:
            await database.close()
        return self.entries

    def _install(self, targets: list[Target]) -> list[Database]:
        """Make ``targets`` current, keeping what is known of those already shown;
        returns the databases no target uses any more."""
        known = {e.target: e.settings for e in self.entries}
        entries = []
        for slug, target in zip(slugs(targets), targets, strict=True):
            settings = known.get(target)
            if settings is None:
                database = self.databases.get(target.dsn)
                if database is None:
                    # Idle connections close after a minute: many databases, few held.
                    database = Database(target.dsn, min_size=0, max_size=4, timeout=10.0,
                                        max_idle=60.0,
                                        kwargs={"connect_timeout": PROBE_TIMEOUT})
                    self.databases[target.dsn] = database
                settings = Settings(target.dsn, target.schema, self.read_only,
                                    self.authorize, self.redact, web_queries(target.schema),
                                    notify_channel(target.schema), shared=database)
            entries.append(Entry(slug, target, settings))
        self.entries = entries
        self.by_slug = {e.slug: e for e in entries}
        used = {e.target.dsn for e in entries}
        gone = [dsn for dsn in self.databases if dsn not in used]
        return [self.databases.pop(dsn) for dsn in gone]

    async def states(self) -> list[TargetState]:
        """Each target up (with its due backlog) or not (and why): one statement per
        target reading its pending jobs, TARGETS_AT_ONCE targets at a time."""
        at_once = asyncio.Semaphore(TARGETS_AT_ONCE)

        async def state(entry: Entry) -> TargetState:
            async with at_once:
                try:
                    await entry.ready()
                    async with transaction(entry.settings) as conn:
                        backlog = await _queue.on_async(
                            conn, _queue.backlog(entry.target.schema))
                except Exception as exc:  # one target's failure is its row's, not the page's
                    reason = failure_reason(exc, entry.target)
                    if reason is None:
                        log.exception("dashboard: reading target %s failed", entry.target.name)
                        reason = f"cannot be read ({type(exc).__name__})"
                    await entry.failed(exc, reason)
                    return TargetState(entry.slug, entry.target.name, False, None, reason)
            return TargetState(entry.slug, entry.target.name, True,
                               sum(b.due for b in backlog.values()), None,
                               any(b.capped for b in backlog.values()))

        return list(await asyncio.gather(*(state(e) for e in self.entries)))

    async def close(self) -> None:
        """Close every database's pool."""
        for database in self.databases.values():
            await database.close()


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


async def _entries(request: Request) -> list[Entry]:
    """The dashboard's targets, or Denied (503) when the targets function fails."""
    board = board_of(request)
    assert board is not None
    try:
        return await board.current()
    except TargetsUnreadable as exc:
        raise Denied(render(request, "target.html", {
            "heading": "The targets cannot be read", "reason": None, "listed": [],
            "message": f"The function giving this dashboard's targets failed ({exc}); "
                       "the dashboard's log says why."}, status_code=503)) from None


def _no_such_target(request: Request, entries: list[Entry]) -> Response:
    # Never the text asked for: it may be anything, a connection string included.
    return render(request, "target.html", {
        "heading": "No such target", "reason": None, "listed": entries,
        "message": "This dashboard shows no target at that address. Its targets:"},
        status_code=404)


def _unavailable(request: Request, entry: Entry, reason: str) -> Response:
    return render(request, "target.html", {
        "heading": f"{entry.target.name} cannot be shown", "reason": reason, "listed": [],
        "message": "The dashboard could not read this target; the others are not "
                   "affected. It is tried again on the next request."},
        status_code=503)


async def targets_page(request: Request) -> Response:
    """Every target, up with its due backlog, or why not."""
    await authorized(request, "read")
    entries = await _entries(request)
    if len(entries) == 1:
        return RedirectResponse(f"{_root(request)}/t/{entries[0].slug}/", status_code=303)
    board = board_of(request)
    assert board is not None
    return render(request, "targets.html", {"states": await board.states()})


async def pick(request: Request) -> Response:
    """The header's picker: to the chosen target's overview, or its job list."""
    await authorized(request, "read")
    entries = await _entries(request)
    board = board_of(request)
    assert board is not None
    entry = board.by_slug.get(request.query_params.get("target", ""))
    if entry is None:
        return _no_such_target(request, entries)
    where = "/"
    if request.query_params.get("page") == "jobs":
        status = request.query_params.get("status")
        where = f"/jobs?status={status}" if status in STATUSES else "/jobs"
    return RedirectResponse(f"{_root(request)}/t/{entry.slug}{where}", status_code=303)


async def no_such_target(request: Request) -> Response:
    """/t/... that names no target (or /t/<slug> without its slash)."""
    await authorized(request, "read")
    entries = await _entries(request)
    board = board_of(request)
    assert board is not None
    entry = board.by_slug.get(request.path_params["rest"])
    if entry is not None and request.method in ("GET", "HEAD"):
        return RedirectResponse(f"{_root(request)}/t/{entry.slug}/", status_code=307)
    return _no_such_target(request, entries)


def _root(request: Request) -> str:
    root: str = request.scope.get("root_path", "")
    return root


class TargetRoutes:
    """The pages and actions of one outbox under ``/t/<slug>/``: the caller is checked,
    then the target is found (else 404) and, once, checked reachable and migrated (else
    a page saying why, 503), then served by the routes of a single outbox; a target that
    fails meanwhile answers the same page, not a 500."""

    def __init__(self, routes: list[BaseRoute]) -> None:
        self.router = Router(routes=routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.router(scope, receive, send)
            return
        slug = scope["path_params"]["target"]
        root_path = scope.get("root_path", "")
        scope[ROOT_KEY] = root_path[:len(root_path) - len(f"/t/{slug}")]
        request = Request(scope, receive)
        try:
            entry = await self._admit(request, slug)
        except Denied as denied:
            denied.response.headers.update(SECURITY_HEADERS)
            await denied.response(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.router(scope, receive, tracked)
        except Exception as exc:
            reason = failure_reason(exc, entry.target)
            if reason is None or started:
                raise
            await entry.failed(exc, reason)
            response = _unavailable(request, entry, reason)
            response.headers.update(SECURITY_HEADERS)
            await response(scope, receive, send)

    async def _admit(self, request: Request, slug: str) -> Entry:
        """The chosen target, ready to be shown; else Denied with the page to send."""
        entries = await _entries(request)
        board = board_of(request)
        assert board is not None
        entry = board.by_slug.get(slug)
        if entry is not None:
            request.scope[TARGET_KEY] = entry.target
        await authorized(request, "read")
        if entry is None:
            raise Denied(_no_such_target(request, entries))
        request.scope[SETTINGS_KEY] = entry.settings
        if request.scope["path"] != f"{request.scope['root_path']}/metrics":
            # (/metrics answers outbox_database_up 0 for a target out of reach)
            try:
                await entry.ready()
            except Exception as exc:
                reason = failure_reason(exc, entry.target)
                if reason is None:
                    raise
                await entry.failed(exc, reason)
                raise Denied(_unavailable(request, entry, reason)) from None
        return entry


def _guarded(endpoint: Any) -> Any:
    async def guarded(request: Request) -> Response:
        try:
            response: Response = await endpoint(request)
        except Denied as denied:
            response = denied.response
        response.headers.update(SECURITY_HEADERS)
        return response

    guarded.__name__ = endpoint.__name__
    guarded.__doc__ = endpoint.__doc__
    return guarded


def create_app(conninfo: str | None = None, *, schema: str = "outbox", read_only: bool = False,
               authorize: Authorizer | None = None, redact: Redactor | None = None,
               targets: TargetsSource | None = None) -> Starlette:
    """The dashboard as an ASGI app for ``schema`` on the database at ``conninfo``; or,
    with ``targets=[outbox.Target(dsn, schema), ...]`` instead (or a function returning
    them, read again when its list is 5 s old), for several outboxes.

    Guarantees: pages only read; every action is a POST, refused cross-site (403), and a
    single fenced statement conditional on the status and claim_version the operator saw,
    written to ``dashboard_audit`` in the same transaction; a job that moved on changes 0
    rows and the operator is told so. ``read_only=True`` (or a read-only database, or a
    role that cannot update the jobs) hides and refuses every action. ``authorize``
    (sync or async) maps a request to None (refused), ``"read"`` or ``"operate"``;
    without it everyone who can reach the app may operate, which is why ``outbox web``
    binds loopback unless a password is set. Payloads pass through ``redact(effect,
    payload)`` before display (default: JSON cut at 2000 characters); everything shown
    is HTML-escaped.

    With targets, ``/`` lists them (each up with its due backlog, or why not), each
    target's pages and actions are under ``/t/<slug>/`` (its name, ``#`` written ``~``),
    and a picker in every page's header switches between them. An action acts on the
    target of its URL only. A target the URL does not name answers 404; one that is out
    of reach or not migrated answers a page saying so (its name and why, never the
    password) while the others go on. ``authorize`` sees the chosen target as
    ``request.scope["outbox.target"]`` (None on the list of targets).
    """
    redact = redact or default_redact
    if targets is not None:
        if conninfo is not None or schema != "outbox":
            raise ConfigurationError(
                "create_app(): give a connection string (and schema=) or targets=, not "
                "both: each Target names its database and schema")
        return _targets_app(Board(targets, read_only=read_only, authorize=authorize,
                                  redact=redact))
    if conninfo is None:
        raise ConfigurationError(
            "create_app() needs a connection string, or targets=[outbox.Target(...), ...]")
    check_schema_name(schema)
    settings = Settings(conninfo, schema, read_only, authorize, redact,
                        web_queries(schema), notify_channel(schema))

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await settings.close()

    routes = [*_outbox_routes(),
              Mount("/static", StaticFiles(directory=HERE / "static"), name="static")]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.outbox = settings
    return app


def _outbox_routes() -> list[BaseRoute]:
    """The pages and actions of one outbox."""
    from ._schedules import schedule_action, schedules_page  # it imports this module

    return [
        Route("/", _guarded(overview), name="overview"),
        Route("/jobs", _guarded(job_list), name="jobs"),
        Route("/jobs/bulk-retry", _guarded(bulk_retry), methods=["POST"]),
        Route("/jobs/{job_id:int}", _guarded(job_detail), name="job"),
        Route("/jobs/{job_id:int}/{action:str}", _guarded(job_action), methods=["POST"]),
        Route("/effects/{action:str}", _guarded(effect_action), methods=["POST"]),
        Route("/metrics", _guarded(metrics), name="metrics"),
        Route("/schedules", _guarded(schedules_page), name="schedules"),
        Route("/schedules/{action:str}", _guarded(schedule_action), methods=["POST"]),
    ]


def _targets_app(board: Board) -> Starlette:
    """The dashboard over the targets of ``board``."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await board.close()

    routes = [
        Route("/", _guarded(targets_page), name="targets"),
        Route("/pick", _guarded(pick), name="pick"),
        Mount("/t/{target}", app=TargetRoutes(_outbox_routes())),
        Route("/t/{rest:path}", _guarded(no_such_target), methods=["GET", "POST"]),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.outbox = board
    return app
