"""What a run with groups (``ChaosConfig.groups``) reports about them: how the jobs were
spread, the limits the workers declared, what those limits let through, and how long
jobs of each kind waited.

No more running jobs of a group than a concurrency limit allows is checked twice: in
every sample of the monitor (``effects.chaos.monitor``) and, here, over every provider
call of the audit once the run has drained. The figures are read then, from the jobs
table and the audit:

- ``calls_in_flight``: per effect under a concurrency, the most provider calls of one
  group in flight at once as the audit saw them, counting the calls whose claim lasted
  the whole call: the job was running under the call's claim when the call began and
  still when it ended (a claim that ended never comes back), so the limit counted it
  all along. Above the limit is a violation (``concurrency_exceeded``, with the calls
  at that instant): unlike the monitor's samples it sees overlaps of a few
  milliseconds. Left out, and counted: calls begun outside their claim (a worker
  frozen past its lease performs when it thaws; the limit has let another job in
  meanwhile, rightly), calls whose claim ended during them (the lease lost) and calls
  whose end was never recorded (the worker killed).
- ``calls_per_window``: per effect under a rate, the most calls of one group begun
  within ``window`` (10) seconds under a live claim, against the most claims the
  group's token bucket admits in as long, ``rate`` x ``window`` + ``burst`` (retries
  are claims too). A call begins a little after its claim (it waits for a worker
  thread in its dispatcher), so this is an estimate of what the bucket let through,
  not a check.
- ``seconds_to_end``: from commit to the job's end (``updated_at - created_at``), median
  and worst, for the heavy group, the other groups and the jobs with no group, and per
  priority.

A limit is counted in each target's own tables, so with several targets
(``ChaosConfig.targets``) the calls are counted per target and group; a group over its
limit is named with its target.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import psycopg

from outbox import Limit

from ._sql import ChaosQueries
from .config import ChaosConfig
from .database import connect
from .schedule import JobPlan, group_name

__all__ = ["group_figures"]

_WINDOW = 10  # seconds: calls_per_window in queries.sql


def group_figures(config: ChaosConfig, plan: JobPlan, dsn: str,
                  queries: ChaosQueries) -> tuple[dict[str, Any], list[str]]:
    """The groups section of the report (empty for a run without groups or limits), and
    the instants where more calls of a group were in flight under live claims than its
    concurrency allows (each a violation)."""
    limits = config.effect_limits
    over: list[str] = []
    if not config.groups and not limits:
        return {}, over
    jobs = plan.committed()
    heavy = group_name(0)
    figures: dict[str, Any] = {
        "groups": config.groups,
        "heavy_group": heavy if config.groups else None,
        "jobs": {"heavy_group": sum(1 for job in jobs if job.group == heavy),
                 "other_groups": sum(1 for job in jobs if job.group not in (None, heavy)),
                 "no_group": sum(1 for job in jobs if job.group is None),
                 "groups_used": len({job.group for job in jobs if job.group is not None})},
        "priorities": {str(p): n for p, n in sorted(Counter(job.priority for job in jobs)
                                                     .items(), reverse=True)},
        # as outbox run --limit reads them: 25/s,per_group
        "limits": {effect: str(limit) for effect, limit in sorted(limits.items())},
    }
    try:
        with connect(dsn, "chaos groups") as conn:
            figures["calls_in_flight"] = _calls_in_flight(conn, queries, limits, over,
                                                          name_targets=config.targets > 1)
            figures["calls_per_window"] = _calls_per_window(conn, queries, limits)
            figures["seconds_to_end"] = _seconds_to_end(conn, queries, heavy)
    except psycopg.OperationalError as exc:
        figures["unreadable"] = f"{type(exc).__name__}: {exc}"
    return figures, over


def _calls_in_flight(conn: psycopg.Connection[Any], queries: ChaosQueries,
                     limits: dict[str, Limit], over: list[str], *,
                     name_targets: bool) -> dict[str, Any]:
    capped = {effect: limit for effect, limit in limits.items() if limit.concurrency}
    if not capped:
        return {}
    whole = [effect for effect, limit in capped.items() if not limit.per_group]
    rows = conn.execute(queries.calls_in_flight,
                        {"effects": sorted(capped), "whole": whole}).fetchall()
    figures: dict[str, Any] = {}
    for effect, group, most, at, counted, outside, outlived, unended, target in rows:
        limit = capped[effect].concurrency or 0
        figure = figures.setdefault(effect, {
            "most": 0, "group": None, "at": None, "limit": limit, "groups_over_limit": 0,
            "calls_counted": 0, "begun_outside_claim": 0, "claim_ended_during": 0,
            "end_unrecorded": 0})
        if most > figure["most"]:
            figure.update(most=most, group=group, at=at)
        figure["groups_over_limit"] += most > limit
        figure["calls_counted"] += counted
        figure["begun_outside_claim"] += outside
        figure["claim_ended_during"] += outlived
        figure["end_unrecorded"] += unended
        if most > limit:
            calls = conn.execute(queries.calls_at, {"effect": effect, "g": group, "at": at,
                                                    "target": target}).fetchall()
            where = f"group {group!r}" if group is not None else "in all"
            if name_targets:
                where += f" of target {target}"
            listed = "; ".join(
                f"{key} v{version} by {worker} {started:%H:%M:%S.%f}-{finished:%H:%M:%S.%f} "
                f"{str(outcome)[:40]} (job ended v{final} {status})"
                for key, version, worker, started, finished, outcome, final, status in calls)
            over.append(f"{effect} {where}: {most} provider calls in flight under live "
                        f"claims at {at.isoformat()}, limit {limit}: {listed}")
    for figure in figures.values():
        figure["at"] = figure["at"].isoformat() if figure["at"] is not None else None
    return figures


def _calls_per_window(conn: psycopg.Connection[Any], queries: ChaosQueries,
                      limits: dict[str, Limit]) -> dict[str, Any]:
    rated = {effect: limit for effect, limit in limits.items() if limit.rate}
    if not rated:
        return {}
    whole = [effect for effect, limit in rated.items() if not limit.per_group]
    rows = conn.execute(queries.calls_per_window,
                        {"effects": sorted(rated), "whole": whole}).fetchall()
    figures: dict[str, Any] = {}
    for effect, group, most, _target in rows:
        limit = rated[effect]
        if effect not in figures or most > figures[effect]["most"]:
            rate = limit.rate or 0.0
            burst = limit.burst if limit.burst is not None else max(1.0, rate / 2)
            figures[effect] = {"most": most, "group": group, "window": _WINDOW,
                               "bucket_admits": round(rate * _WINDOW + burst, 1)}
    return figures


def _seconds_to_end(conn: psycopg.Connection[Any], queries: ChaosQueries,
                    heavy: str) -> dict[str, dict[str, Any]]:
    figures: dict[str, dict[str, Any]] = {}
    for kind, jobs, median, worst in conn.execute(queries.seconds_to_end,
                                                  {"heavy": heavy}).fetchall():
        figures[str(kind)] = {"jobs": int(jobs), "median": round(float(median), 2),
                              "max": round(float(worst), 2)}
    return figures
