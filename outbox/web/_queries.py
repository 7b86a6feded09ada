"""The dashboard's named SQL blocks (``web/queries.sql``), bound to a schema once, and
the records their rows are read as: templates name the columns they show."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from functools import cache
from typing import Any

from psycopg import sql

from .._sql import BoundQueries, bind_file, check_schema_name


class WebQueries(BoundQueries):
    """The dashboard's statements for one schema; attribute access by block name."""

    def __init__(self, schema: str) -> None:
        identifier = sql.Identifier(check_schema_name(schema))
        # job_filter, shared by the list, its count and the queue model's bulk retry, is
        # a fragment of the core's sql/queue.sql.
        super().__init__(bind_file("outbox.web", "queries.sql", schema), "web/queries.sql")
        # Table names for has_table_privilege(), quoted as PostgreSQL reads them.
        self.jobs_table = sql.SQL("{}.jobs").format(identifier).as_string(None)
        self.audit_table = sql.SQL("{}.dashboard_audit").format(identifier).as_string(None)


@cache
def web_queries(schema: str) -> WebQueries:
    """The statements for ``schema``, composed once per schema and process."""
    return WebQueries(schema)


@dataclass(frozen=True, slots=True)
class Writable:
    """Whether this session may act (``writable``)."""

    writable: bool


@dataclass(frozen=True, slots=True)
class Settled:
    """Jobs that reached a final state in one minute (``settled_per_minute``)."""

    minute: datetime
    done: int
    failed: int


@dataclass(frozen=True, slots=True)
class Holder:
    """A worker holding claims now (``dispatchers``)."""

    claimed_by: str | None
    running: int
    next_lease_end: datetime | None
    last_claim: datetime | None


@dataclass(frozen=True, slots=True)
class SeenEffect:
    """An effect name for the filter menu (``effects_seen``)."""

    effect: str


@dataclass(frozen=True, slots=True)
class Listed:
    """A job as the job list shows it (``job_page``)."""

    id: int
    effect: str
    key: str
    status: str
    attempts: int
    max_attempts: int
    claim_version: int
    available_at: datetime
    created_at: datetime
    updated_at: datetime
    last_error: str | None


@dataclass(frozen=True, slots=True)
class CappedCount:
    """Matching jobs, counted up to a cap (``job_count``)."""

    jobs: int


@dataclass(frozen=True, slots=True)
class LedgerRow:
    """The ledger row of a job's key (``job_ledger``)."""

    job_id: int
    claim_version: int
    result: Any
    recorded_at: datetime


@dataclass(frozen=True, slots=True)
class JobAudit:
    """A dashboard action on one job (``job_audit``)."""

    at: datetime
    actor: str
    action: str
    detail: Any
    affected: int


@dataclass(frozen=True, slots=True)
class RecentAudit:
    """A recent dashboard action, on a job or in bulk (``recent_audit``)."""

    at: datetime
    actor: str
    action: str
    job_id: int | None
    detail: Any
    affected: int


@dataclass(frozen=True, slots=True)
class Flow:
    """A job's place in its flow and its reconciliation schedule (``job_flow``)."""

    parent_key: str | None
    parent_id: int | None
    parent_status: str | None
    kept_result: bool
    reconcile_at: datetime | None
    reconcile_checks: int


@dataclass(frozen=True, slots=True)
class Followup:
    """A job a completion hook of this job enqueued (``job_followups``)."""

    id: int
    effect: str
    key: str
    status: str
    updated_at: datetime


@dataclass(frozen=True, slots=True)
class Related:
    """A parent (the job waits on it) or a child (it waits on the job) of fan-in
    (``job_after``): ``id`` and ``status`` are None when only the ledger remembers the
    parent (done); ``outcome`` is the edge's (None while the parent is to come)."""

    relation: str
    key: str
    id: int | None
    status: str | None
    effect: str | None
    outcome: str | None


@dataclass(frozen=True, slots=True)
class Reconciled:
    """A decision of the reconciler about a job (``job_reconciliation``)."""

    at: datetime
    decision: str | None
    source: str | None
    affected: int


@dataclass(frozen=True, slots=True)
class FailedGroup:
    """Failed jobs of one effect and error fingerprint (the core's ``failed_groups``);
    ``search`` is what the job list searches errors for to find them (set by the app)."""

    effect: str
    fingerprint: str
    jobs: int
    latest: datetime
    sample: str | None
    search: str = ""
