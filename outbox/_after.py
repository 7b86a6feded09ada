"""Fan-in: jobs that wait for other jobs (``tx.enqueue(..., after=[key, ...])``).

A child names its parents by key. It is an ordinary ``pending`` job that is not due: its
``available_at`` stands at a fixed date far ahead (``after_never`` in ``sql/after.sql``)
and ``after_waiting`` counts the parents not settled yet, so the claim's rule, the "due"
counts and the metrics pass it by without knowing of fan-in. One edge row per (child,
parent key) in ``after_edges`` (migration 0015) links them.

- At enqueue (``check_steps``, ``link_steps``): every parent must exist as a job or a
  ledger row (in the business transaction's view: an earlier transaction's, or one
  enqueued earlier in this one), else ``UnknownParent`` before anything is written. So
  no cycle can be built: a parent exists before any child names it, and a key that is
  already a job never gains parents (a repeated enqueue writes nothing). Parents done
  already count as resolved: a child whose parents are all done is due at once. What
  its parents' states make of a child (failed, waiting, due) is decided by
  ``_lifecycle.parent_settled`` (``link_steps``).
- When a parent is settled for good, the statement that settles it (the recorder's
  fenced ``complete`` and ``settle``, the rescue, the hooks' and the reconciler's fenced
  writes, an operator's cancel or resolve) resolves its edges and counts its children
  down in the same transaction (fragment ``after_released``): set-based, one statement
  however many children, the rule of ``_lifecycle.parent_settled``, whose table of cases
  (``_lifecycle.PARENT_SETTLED``) the fragment's CASE expressions are rendered from
  (``outbox._rule_sql``), so the two cannot differ.
- The race: a child enqueued in a transaction still open while its parent's settlement
  commits. Under READ COMMITTED neither sees the other (the child's check saw the parent
  unsettled; the settlement did not see the uncommitted edges). Locks could order them,
  but only by making the recorder wait on business transactions. Instead each dispatcher
  sweeps (``Sweep``): a bounded walk of the unresolved edges, a batch a round, that
  resolves those whose parent is settled. The walk revisits every unresolved edge, so no
  child is left waiting once its parents are settled; most edges are resolved by the
  settlement itself, so the sweep finds almost nothing to do.
- A parent failed for good fails its waiting children (``after_failed="fail"``, the
  default), never performed, with ``last_error`` naming the parent's key; with
  ``after_failed="run"`` the child runs once its other parents are settled, and
  ``job.after_results`` maps the failed parent to a ``FailedParent``. A parent in
  ``reconcile`` is not settled: its children wait until a person or the reconciler
  resolves it. An operator's retry of a failed parent does not revive children that
  failed with it: they are failed for good (a saga may have compensated already); retry
  them too if that is what is wanted, and each then runs at once, with the results of
  the parents that are done.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

from . import _lifecycle
from ._sql import BoundQueries, bind_file, check_schema_name
from ._steps import Statement, Step
from .errors import InvalidArgument, UnknownParent

if TYPE_CHECKING:
    from ._enqueue import PreparedJob

__all__ = [
    "AFTER_MODES",
    "AfterQueries",
    "FailedParent",
    "Sweep",
    "after_queries",
    "check_steps",
    "link_steps",
    "results_steps",
    "validate_after",
]

log = logging.getLogger("outbox.dispatcher")

AFTER_MODES = ("fail", "run")
"""What a parent failing for good does to a child: fail it too, or let it run."""
SWEEP_BATCH = 1000
"""Unresolved edges the sweep looks at per call."""


@dataclass(frozen=True, slots=True)
class FailedParent:
    """A parent that failed for good, as a child enqueued with ``after_failed="run"``
    sees it in ``job.after_results`` (in place of a result): its ``key`` and its
    ``error`` (the parent's ``last_error``, shortened; None if it had none).

    :var key: The parent job's idempotency key.
    :var error: The parent's ``last_error``, shortened; None if it had none.
    """

    key: str
    error: str | None = None


class AfterQueries(BoundQueries):
    """The statements of ``sql/after.sql`` for one schema; attribute access by name."""

    def __init__(self, schema: str) -> None:
        self.schema = check_schema_name(schema)
        super().__init__(bind_file("outbox", "sql/after.sql", schema), "sql/after.sql")


@cache
def after_queries(schema: str) -> AfterQueries:
    """The statements for ``schema``, composed once per schema and process."""
    return AfterQueries(schema)


def validate_after(after: object, key: str, after_failed: object,
                   ) -> tuple[tuple[str, ...], str]:
    """``after`` as a tuple of unique keys in the order given, and ``after_failed``;
    raise ``InvalidArgument`` (or ``InvalidKey``) saying what is wrong and where."""
    from ._enqueue import validate_key  # the key rules live with enqueue's

    if after_failed not in AFTER_MODES:
        raise InvalidArgument(
            f"after_failed must be 'fail' (the job fails when a parent fails for good) or "
            f"'run' (it runs anyway and sees which parents failed), got {after_failed!r}"[:200])
    if after is None:
        return (), str(after_failed)
    if isinstance(after, str | bytes) or not isinstance(after, Iterable):
        raise InvalidArgument(
            f"after must be a list of job keys (after=[{after!r}] for one), "
            f"got {type(after).__name__} {str(after)[:60]!r}")
    keys: dict[str, None] = {}
    for index, parent in enumerate(after):
        validate_key(parent, what=f"after[{index}]")
        if parent == key:
            raise InvalidArgument(f"after[{index}] is the job's own key {key!r}: a job "
                                  "cannot wait for itself")
        keys[parent] = None
    return tuple(keys), str(after_failed)


def check_steps(jobs: Sequence[PreparedJob], schema: str) -> Step[None]:
    """Raise ``UnknownParent`` unless every parent the ``jobs`` name holds a job or a
    ledger row, or is a job earlier in ``jobs`` (a batch may name its own earlier
    entries; never a later one, see ``_enqueue.prepare_many``). One statement."""
    in_batch = {job.key for job in jobs}
    wanted = sorted({k for job in jobs for k in job.after if k not in in_batch})
    if not wanted:
        return
    unknown = yield Statement(after_queries(schema).after_unknown, {"keys": wanted},
                              scalar=True)  # the keys nothing holds
    if unknown:
        missing = set(unknown)
        child = next(job for job in jobs if missing & set(job.after))
        raise UnknownParent([k for k in child.after if k in missing], child.key)


@dataclass(frozen=True, slots=True)
class _ParentState:
    """What one parent says about a child just created (``after_states``): 'done' or
    'failed' when settled for good, None while it is to come; and its error."""

    child_id: int
    key: str
    outcome: str | None
    error: str | None


def link_steps(children: Sequence[tuple[int, PreparedJob]], schema: str) -> Step[None]:
    """Give the children just created (id, job) their edges, and each the state its
    parents decide (``_lifecycle.parent_settled``: failed when one failed for good and
    the child says ``"fail"``; else waiting on those still to come, or due now). Two
    statements for any number of children and parents: the parents' states read, the
    decisions applied."""
    if not children:
        return
    q = after_queries(schema)
    wanted = json.dumps([{"id": job_id, "after": list(job.after)} for job_id, job in children],
                        separators=(",", ":"))
    rows: list[_ParentState] = yield Statement(q.after_states, {"links": wanted},
                                               row=_ParentState)
    states: dict[int, list[_ParentState]] = {}
    for state in rows:
        states.setdefault(state.child_id, []).append(state)
    links = [_link(job_id, job, states.get(job_id, [])) for job_id, job in children]
    yield Statement(q.after_link, {"links": json.dumps(links, separators=(",", ":"))})


def _link(job_id: int, job: PreparedJob, states: Sequence[_ParentState]) -> dict[str, Any]:
    """One child's edges and what its parents' states decide for it."""
    failed = min((s for s in states if s.outcome == "failed"), key=lambda s: s.key,
                 default=None)
    waiting = sum(s.outcome is None for s in states)
    mode: _lifecycle.Mode = "run" if job.after_failed == "run" else "fail"
    decision = _lifecycle.parent_settled(
        mode, len(states), failed.key if failed else None, failed.error if failed else None,
        settled=len(states) - waiting)
    return {"id": job_id, "mode": job.after_failed,
            "edges": [[s.key, s.outcome] for s in states],
            "status": decision.status, "error": decision.error, "waiting": waiting,
            "waits": decision.status == "pending" and decision.delay == _lifecycle.NEVER}


def results_steps(ids: Sequence[int], schema: str) -> Step[dict[int, dict[str, Any]]]:
    """What the claimed children ``ids`` see of their parents, by child id: parent key ->
    its ledger result (decoded), or a ``FailedParent`` for a parent failed for good."""
    rows = yield Statement(after_queries(schema).after_results, {"ids": list(ids)},
                           named=True)
    seen: dict[int, dict[str, Any]] = {}
    for row in rows:
        parents = seen.setdefault(row.child_id, {})
        if row.outcome == "failed":
            parents[row.parent_key] = FailedParent(row.parent_key, row.error)
        elif row.outcome == "done":
            parents[row.parent_key] = None if row.result is None else json.loads(row.result)
    return seen


class Sweep:
    """The dispatcher's walk of the unresolved edges (``after_sweep``): resolves those
    whose parent is settled, which the settlement could not see (the race above). A call
    looks at ``SWEEP_BATCH`` edges after where the previous one stopped (``behind`` until
    the walk reaches the end; it then starts again from the first child). The claimer
    calls it with its rescue, and at every round while it is behind."""

    START = (0, "")  # before every edge (ids are positive)

    def __init__(self, schema: str) -> None:
        self.query = after_queries(schema).after_sweep
        self.walked_to = self.START  # the last edge looked at (child id, parent key)

    @property
    def behind(self) -> bool:
        """Whether a walk stopped at its batch, in the middle of the edges."""
        return self.walked_to != self.START

    def restart(self) -> None:
        """The next call walks from the first edge."""
        self.walked_to = self.START

    def sweep(self) -> Step[int]:
        """One call: the children woken (released or failed)."""
        child, parent = self.walked_to
        rows = yield Statement(self.query, {"child": child, "parent": parent,
                                            "limit": SWEEP_BATCH}, named=True)
        row = rows[0] if rows else None
        woken = int(row.woken) if row is not None else 0
        self.walked_to = (self.START if row is None or row.walked_child is None
                          else (int(row.walked_child), str(row.walked_parent)))
        if woken:
            log.info("fan-in sweep settled %s job(s) whose parents were settled while "
                     "they were being enqueued", woken)
        return woken


def results_of(found: Mapping[int, dict[str, Any]], job_id: int) -> dict[str, Any]:
    """The ``after_results`` of one claimed child (an empty dict when none were read)."""
    return found.get(job_id, {})
