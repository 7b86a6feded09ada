"""The dashboard's schedules page (``outbox.Schedule``): each schedule with when it
fires, where it is defined, its next slot and its last job; pause and resume, audited as
``outbox schedules pause`` / ``resume`` are (the same steps, ``outbox._schedule_store``)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response

from .. import _schedule_store
from .._steps import execute_async, run_async
from .app import VIA, authorized, pause_form, render, settings_of, transaction, writable

__all__ = ["schedule_action", "schedules_page"]


async def schedules_page(request: Request) -> Response:
    """Every schedule with its state; pause / resume buttons for an operator."""
    access = await authorized(request, "read")
    settings = settings_of(request)
    async with transaction(settings) as conn:
        listed = await run_async(_schedule_store.listing(settings.schema),
                                 lambda statement: execute_async(conn, statement))
        can_act = access == "operate" and await writable(settings, conn)
    return render(request, "schedules.html", {
        "schedules": listed, "can_act": can_act,
        "outcome": request.query_params.get("outcome", "")[:80]})


async def schedule_action(request: Request) -> Response:
    """Pause or resume one schedule for every dispatcher (audited)."""
    _, actor, pause, name = await pause_form(request, "name",
                                             "name: the schedule's name is required")
    settings = settings_of(request)
    async with transaction(settings) as conn:
        if not await writable(settings, conn):
            return PlainTextResponse("the database is read-only for the dashboard", 403)
        changed = await run_async(
            _schedule_store.set_paused(name, pause, settings.schema, actor, VIA),
            lambda statement: execute_async(conn, statement))
    if changed is None:
        return PlainTextResponse(f"no schedule {name[:200]!r}", status_code=404)
    outcome = f"{name} {'paused' if pause else 'resumed'}" if changed else (
        f"{name} was already {'paused' if pause else 'running'}")
    base = request.scope.get("root_path", "")
    return RedirectResponse(f"{base}/schedules?outcome={outcome}", status_code=303)
