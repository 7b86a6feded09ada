"""The queue as operators read and operate it: jobs per status and effect, each effect's
health, and the operator's transitions.

One model for every surface that reports or operates the queue (the dashboard,
``outbox status`` and ``outbox retry``, the Prometheus database collector), so they
count alike, say "due" alike, and act alike:

- counts are exact for every status with at most ``COUNT_CAP`` jobs; a status with more
  is estimated from a block sample, so no reading's cost follows the backlog or the
  history (the busiest groups likewise);
- "due" applies the claim's own rules (``sql/queue.sql``, block ``effect_health``): a
  job held back by its ordering key waits for its key-mate, not for a dispatcher, so it
  is neither due nor part of the oldest due age; a job waiting on its parents
  (``after=[...]``) is counted apart, as ``waiting``;
- the transitions (``retry``, ``cancel``, ``resolve``, ``bulk_retry``) are decided by
  ``_lifecycle.operator_action`` for the job as read, and applied by one statement
  (``operator_apply``; a bulk retry: ``bulk_retry``): fenced on the status and
  claim_version read (a job that moved on since it was read, or since the operator saw
  it, changes 0 rows, and the answer says it ``moved``), audited in ``dashboard_audit``
  with the actor and the surface, and announced on the schema's channel, so a listening
  dispatcher takes a retried job at once.

Readings and transitions are steps (``outbox._steps``): the same statements and
the same interpretation of their rows, driven on a blocking connection (``on``, ``read``)
or an asyncio one (``on_async``, ``read_async``). Callers bound the transaction
(read-only and a statement timeout for a reading; a transition commits with it, and its
notification is delivered then).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from functools import cache
from typing import Any, TypeVar

import psycopg

from . import _lifecycle
from ._enqueue import notify_channel
from ._lifecycle import Decision
from ._sql import BoundQueries, bind_file, check_schema_name
from ._steps import Statement, Step, execute, execute_async, run, run_async

__all__ = [
    "COUNT_CAP",
    "GROUP_CAP",
    "SAMPLED_ENOUGH",
    "SAMPLE_PAGES",
    "STATUSES",
    "Backlog",
    "Counted",
    "Counts",
    "Due",
    "EffectHealth",
    "GroupSample",
    "Operator",
    "QueueQueries",
    "Retried",
    "Sampled",
    "Seen",
    "Selection",
    "Snapshot",
    "TableSize",
    "Transition",
    "backlog",
    "bulk_retry",
    "cancel",
    "capped_statuses",
    "on",
    "on_async",
    "queue_queries",
    "read",
    "read_async",
    "resolve",
    "retry",
    "sample_percent",
    "snapshot",
    "with_estimates",
]

T = TypeVar("T")

STATUSES = ("pending", "running", "done", "failed", "reconcile")
COUNT_CAP = 10_000
"""Jobs of one status read at most to count them: a status with more is estimated."""
GROUP_CAP = 2_000
"""Pending jobs read at most to rank the busiest groups exactly: past it, estimated."""
SAMPLED_ENOUGH = 10
"""Jobs of a group a sample must see for its estimate to be used (about +-30 %): with
fewer, the busiest of thousands of small groups would be the luckiest, not the largest."""
SAMPLE_PAGES = 200
"""Pages of the jobs table a block sample reads (about 10,000 rows) when a status past
``COUNT_CAP`` is estimated (or the busiest groups past ``GROUP_CAP``): sized by the
table's pages now, not by its statistics, which may be old."""

CountMap = dict[tuple[str, str], int]


def sample_percent(pages: int) -> float:
    """The TABLESAMPLE percentage that reads about ``SAMPLE_PAGES`` of a table of
    ``pages`` pages."""
    return min(100.0, 100.0 * SAMPLE_PAGES / max(pages, 1))


@dataclass(frozen=True, slots=True)
class TableSize:
    """The jobs table as the planner sees it, and its pages now (``table_size``)."""

    estimate: int
    dead_tuples: int
    pages: int = 0


@dataclass(frozen=True, slots=True)
class Counted:
    """Jobs of one status and effect (``counts_capped``)."""

    status: str
    effect: str
    jobs: int


@dataclass(frozen=True, slots=True)
class Sampled:
    """Jobs of one status and effect (and, pending, of one group: '' for none) seen in
    a block sample (``status_sample``)."""

    status: str
    effect: str
    sampled: int
    group_key: str | None = None


@dataclass(frozen=True)
class GroupSample:
    """The pending jobs per (effect, group) a block sample of ``percent`` saw: what the
    counts' sample leaves for ``busiest_groups``, which then takes none of its own."""

    percent: float
    pending: dict[tuple[str, str], int]


def capped_statuses(counted: Iterable[Counted], cap: int) -> frozenset[str]:
    """The statuses of which ``counts_capped`` read more than ``cap`` jobs: their counts
    are lower bounds, to be estimated."""
    totals: dict[str, int] = {}
    for c in counted:
        totals[c.status] = totals.get(c.status, 0) + int(c.jobs)
    return frozenset(status for status, n in totals.items() if n > cap)


def with_estimates(counted: Iterable[Counted], sample: Iterable[Sampled], percent: float,
                   estimated: frozenset[str]) -> CountMap:
    """Exact counts of the statuses not in ``estimated``; for those, the sample scaled up
    (a block sample of ``percent`` sees that share of the rows), never below what the
    capped count saw."""
    counts = {(c.status, c.effect): int(c.jobs) for c in counted}
    sampled: CountMap = {}
    for s in sample:
        if s.status in estimated:
            sampled[(s.status, s.effect)] = sampled.get((s.status, s.effect), 0) + int(s.sampled)
    scale = 100.0 / percent
    for label, n in sampled.items():
        counts[label] = max(counts.get(label, 0), round(n * scale))
    return counts


@dataclass(frozen=True, slots=True)
class Due:
    """One effect's pending jobs that are due, and its live dispatchers (``due_by_effect``)."""

    effect: str
    due: int
    dispatchers: int
    waiting: int = 0  # waiting on parents (after=[...]): not due


@dataclass(frozen=True, slots=True)
class Retried:
    """How many jobs a bulk retry sent back to pending (``bulk_retry``)."""

    retried: int


@dataclass(frozen=True)
class Counts:
    """Jobs per (status, effect): exact for every status with at most ``COUNT_CAP`` jobs,
    estimated for those in ``approximate`` (from a block sample)."""

    counts: CountMap
    approximate: frozenset[str]
    dead_tuples: int

    @property
    def estimated(self) -> bool:
        """Whether any status was estimated."""
        return bool(self.approximate)

    def total(self, status: str) -> int:
        """All jobs of ``status``."""
        return sum(n for (s, _), n in self.counts.items() if s == status)

    def get(self, status: str, effect: str) -> int:
        """Jobs of ``status`` and ``effect``."""
        return self.counts.get((status, effect), 0)


@dataclass(frozen=True, slots=True)
class EffectHealth:
    """One effect's health. Ages in seconds, None when there is no such job; a job held
    back by its ordering key is not due (the claim would not take it)."""

    effect: str
    oldest_due_age: float | None
    expired_leases: int
    oldest_reconcile_age: float | None
    waiting: int = 0  # pending jobs waiting on their parents (after=[...]): not due


@dataclass(frozen=True)
class Snapshot:
    """The counts and, per effect with unfinished jobs, the health."""

    counts: Counts
    health: dict[str, EffectHealth]
    sampled_groups: GroupSample | None = None  # when the counts took a sample

    def effects(self) -> set[str]:
        """Every effect the reading saw."""
        return {effect for _, effect in self.counts.counts} | set(self.health)


class QueueQueries(BoundQueries):
    """The statements of ``sql/queue.sql`` for one schema; attribute access by name."""

    def __init__(self, schema: str) -> None:
        self.schema = check_schema_name(schema)
        super().__init__(bind_file("outbox", "sql/queue.sql", schema), "sql/queue.sql")


@cache
def queue_queries(schema: str) -> QueueQueries:
    """The statements for ``schema``, composed once per schema and process."""
    return QueueQueries(schema)


def snapshot(schema: str) -> Step[Snapshot]:
    """Read the counts and the health: five statements at most, whose cost does not
    follow the backlog nor the history (each status read up to ``COUNT_CAP`` jobs, a
    block sample of about ``SAMPLE_PAGES`` pages beyond it, no scan of the due jobs)."""
    q = queue_queries(schema)
    sizes: list[TableSize] = yield Statement(q.table_size, {"schema_name": schema},
                                             row=TableSize)
    size = sizes[0] if sizes else TableSize(0, 0)
    counted: list[Counted] = yield Statement(q.counts_capped, {"cap": COUNT_CAP}, row=Counted)
    approximate = capped_statuses(counted, COUNT_CAP)
    counts = {(c.status, c.effect): int(c.jobs) for c in counted}
    groups = None
    if approximate:
        percent = sample_percent(int(size.pages))
        sample: list[Sampled] = yield Statement(q.status_sample, {"percent": percent},
                                                row=Sampled)
        counts = with_estimates(counted, sample, percent, approximate)
        groups = GroupSample(percent, {(s.effect, s.group_key or ""): int(s.sampled)
                                       for s in sample if s.status == "pending"})
    health: list[EffectHealth] = yield Statement(q.effect_health, {}, row=EffectHealth)
    return Snapshot(Counts(counts, approximate, int(size.dead_tuples)),
                    {h.effect: h for h in health}, groups)


@dataclass(frozen=True, slots=True)
class Backlog:
    """One effect's pending jobs as ``outbox status`` shows them: how many are due (by
    the claim's rules) and how many live dispatchers serve the effect."""

    due: int
    dispatchers: int
    waiting: int = 0  # waiting on parents (after=[...]): neither due nor scheduled
    capped: bool = False  # due counted up to COUNT_CAP and stopped there: at least that


def backlog(schema: str) -> Step[dict[str, Backlog]]:
    """Per effect with pending jobs, its ``Backlog``: due jobs counted up to
    ``COUNT_CAP`` (``capped`` when the count stopped there), never the whole backlog."""
    rows: list[Due] = yield Statement(queue_queries(schema).due_by_effect,
                                      {"cap": COUNT_CAP}, row=Due)
    return {d.effect: Backlog(int(d.due), int(d.dispatchers), int(d.waiting),
                              int(d.due) >= COUNT_CAP) for d in rows}


@dataclass(frozen=True, slots=True)
class GroupBacklog:
    """One group's pending jobs of one effect (``busiest_groups``); ``group_key`` None:
    the jobs enqueued without a group."""

    effect: str
    group_key: str | None
    pending: int


BUSIEST_GROUPS = 5
"""Groups shown per effect by ``outbox status`` and the dashboard's overview."""


def busiest_groups(schema: str, top: int, sampled: GroupSample | None = None,
                   ) -> Step[dict[str, list[GroupBacklog]]]:
    """Per effect with pending jobs, its ``top`` groups by pending jobs, most first:
    exact up to ``GROUP_CAP`` pending jobs; past it, estimated from a block sample for
    the groups it saw at least ``SAMPLED_ENOUGH`` times (never below what the capped
    reading, which reads groups whole in their order, counted), so the reading's cost
    does not follow the backlog. ``sampled``: the sample a ``Snapshot`` of the same
    transaction took (``snapshot.sampled_groups``), used instead of taking another."""
    q = queue_queries(schema)
    rows: list[_Grouped] = yield Statement(q.busiest_groups, {"top": top, "cap": GROUP_CAP},
                                           row=_Grouped)
    pending = {(r.effect, r.group_key): int(r.pending) for r in rows}
    if any(r.capped for r in rows):
        if sampled is None:
            sampled = yield from _group_sample(q, schema)
        for label, n in sampled.pending.items():
            if n < SAMPLED_ENOUGH:
                continue  # too few to tell a busy group from chance: the count stands
            pending[label] = max(pending.get(label, 0), round(n * 100 / sampled.percent))
    found: dict[str, list[GroupBacklog]] = {}
    for (effect, group), n in pending.items():
        found.setdefault(effect, []).append(GroupBacklog(effect, group or None, n))
    return {effect: sorted(groups, key=lambda g: (-g.pending, g.group_key or ""))[:top]
            for effect, groups in sorted(found.items())}


def _group_sample(q: QueueQueries, schema: str) -> Step[GroupSample]:
    sizes: list[TableSize] = yield Statement(q.table_size, {"schema_name": schema},
                                             row=TableSize)
    percent = sample_percent(int(sizes[0].pages) if sizes else 0)
    rows: list[_GroupSampled] = yield Statement(q.group_sample, {"percent": percent},
                                                row=_GroupSampled)
    return GroupSample(percent, {(s.effect, s.group_key): int(s.sampled) for s in rows})


@dataclass(frozen=True, slots=True)
class _Grouped:
    """A row of ``busiest_groups``: '' is the jobs without a group."""

    effect: str
    group_key: str
    pending: int
    capped: bool


@dataclass(frozen=True, slots=True)
class _GroupSampled:
    """Pending jobs of one effect and group in a block sample (``group_sample``)."""

    effect: str
    group_key: str
    sampled: int


# -- the operator's transitions ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Operator:
    """Who acts (``actor``) and through which surface (``via``: ``"dashboard"``,
    ``"command line"``), as the audit trail records them."""

    actor: str
    via: str


@dataclass(frozen=True, slots=True)
class Seen:
    """The job as the operator saw it: a transition changes it only if it still has this
    status and claim_version (None: not checked)."""

    status: str | None = None
    claim_version: int | None = None


@dataclass(frozen=True, slots=True)
class Transition:
    """What a transition of one job did: ``changed`` or not, and the job's status, key
    and effect after it (all None when there is no such job); ``moved``: the action
    applied to the job as it was read (or seen), but the job had moved on since (its
    status or claim_version changed), so nothing was written."""

    changed: bool
    status: str | None = None
    key: str | None = None
    effect: str | None = None
    moved: bool = False


@dataclass(frozen=True, slots=True)
class _Read:
    """The job as ``operator_read`` read it: what the operator's decision weighs and
    the fence of the write that applies it."""

    status: str
    claim_version: int
    last_error: str | None


@dataclass(frozen=True, slots=True)
class Selection:
    """The jobs a bulk action takes (the ``job_filter`` fragment): every condition that
    is None is left out; ``older_than`` and ``newer_than`` are seconds since created."""

    status: str | None = None
    effect: str | None = None
    key_prefix: str | None = None
    older_than: float | None = None
    newer_than: float | None = None
    error: str | None = None

    def params(self) -> dict[str, Any]:
        """Bind parameters of the ``job_filter`` fragment."""
        return asdict(self)

    def describe(self) -> dict[str, Any]:
        """The conditions given, keyed for the audit trail."""
        return {name: value for name, value in asdict(self).items() if value is not None}


ACTIONS = ("retry", "cancel", "resolve_done", "resolve_failed")


def _decided(decision: Decision | None) -> dict[str, Any]:
    """Bind parameters of a decision's writes (``operator_apply``, ``bulk_retry``)."""
    if decision is None:
        decision = Decision("failed")  # applies nothing (apply is false): any values
    return {"status": decision.status, "delay": decision.delay, "error": decision.error,
            "attempts": decision.attempts, "fresh_window": decision.fresh_window,
            "ledger": decision.ledger, "stop": decision.stop,
            "clear_error": decision.clear_error, "waive_parents": decision.waive_parents}


def _transition(schema: str, action: _lifecycle.Action, job_id: int, operator: Operator,
                seen: Seen, note: str | None) -> Step[Transition]:
    """Read the job, decide (``_lifecycle.operator_action``), apply the decision fenced
    on the status and claim_version read (and seen); audited either way."""
    q = queue_queries(schema)
    found: list[_Read] = yield Statement(q.operator_read, {"id": job_id}, row=_Read)
    read = found[0] if found else None
    decision = None if read is None else _lifecycle.operator_action(
        action, read.status, last_error=read.last_error, actor=operator.actor,
        via=operator.via)
    as_seen = read is not None and seen.status in (None, read.status) \
        and seen.claim_version in (None, read.claim_version)
    rows: list[Transition] = yield Statement(q.operator_apply, {
        **_decided(decision), "apply": decision is not None and as_seen,
        "id": job_id, "read_status": read.status if read else None,
        "read_version": read.claim_version if read else None,
        "action": action, "actor": operator.actor, "via": operator.via,
        "seen_version": seen.claim_version, "note": note or None,
        "channel": notify_channel(schema),
    }, row=Transition)
    done = rows[0] if rows else Transition(False)
    if not done.changed and decision is not None and done.status is not None:
        # It applied to the job as read (or seen), but the job moved on before the write.
        return replace(done, moved=True)
    return done


def retry(schema: str, job_id: int, operator: Operator, seen: Seen = Seen(),
          note: str | None = None) -> Step[Transition]:
    """A failed or reconcile job back to pending, with a fresh attempt budget and a fresh
    idempotency window (the key is unchanged). Fenced, audited, dispatchers woken."""
    return _transition(schema, "retry", job_id, operator, seen, note)


def cancel(schema: str, job_id: int, operator: Operator, seen: Seen = Seen(),
           note: str | None = None) -> Step[Transition]:
    """A pending job to failed, never performed; a running one's claim asked to stop
    (its dispatchers are notified; the job stays running until its dispatcher records
    what the perform did). Fenced and audited."""
    return _transition(schema, "cancel", job_id, operator, seen, note)


def resolve(schema: str, job_id: int, operator: Operator, *, performed: bool,
            seen: Seen = Seen(), note: str | None = None) -> Step[Transition]:
    """A reconcile job settled by a person who checked the provider: performed (done,
    with a ledger row naming them, so the key is never performed again) or not (failed).
    Fenced and audited."""
    action: _lifecycle.Action = "resolve_done" if performed else "resolve_failed"
    return _transition(schema, action, job_id, operator, seen, note)


def bulk_retry(schema: str, selection: Selection, operator: Operator, *, cap: int,
               described: Mapping[str, Any] | None = None) -> Step[int]:
    """Failed jobs in ``selection`` back to pending, newest first, at most ``cap``; rows
    another session holds are skipped. Audited as one row with the filter (``described``,
    else the selection's conditions); returns how many were retried."""
    selection = replace(selection, status="failed")  # only failed jobs are retried
    decision = _lifecycle.operator_action("retry", "failed", last_error=None,
                                          actor=operator.actor, via=operator.via)
    assert decision is not None  # a failed job can be retried
    # named apart from the filter's parameters (status, error)
    decided = {f"decided_{name}": value for name, value in _decided(decision).items()}
    rows = yield Statement(queue_queries(schema).bulk_retry, {
        **selection.params(), **decided,
        "cap": cap, "actor": operator.actor, "via": operator.via,
        "described": json.dumps(dict(described) if described is not None
                                else selection.describe()),
        "channel": notify_channel(schema),
    }, row=Retried)
    return int(rows[0].retried) if rows else 0


# -- drivers ----------------------------------------------------------------------------


def on(conn: psycopg.Connection[Any], step: Step[T]) -> T:
    """Drive ``step`` on a blocking connection, in the caller's transaction (or, in
    autocommit, each statement committing on its own)."""

    return run(step, lambda statement: execute(conn, statement))


async def on_async(conn: psycopg.AsyncConnection[Any], step: Step[T]) -> T:
    """Drive ``step`` on an asyncio connection, in the caller's transaction."""

    return await run_async(step, lambda statement: execute_async(conn, statement))


def read(conn: psycopg.Connection[Any], schema: str) -> Snapshot:
    """``snapshot`` on a blocking connection, inside the caller's transaction."""
    return on(conn, snapshot(schema))


async def read_async(conn: psycopg.AsyncConnection[Any], schema: str) -> Snapshot:
    """``snapshot`` on an asyncio connection, inside the caller's transaction."""
    return await on_async(conn, snapshot(schema))
