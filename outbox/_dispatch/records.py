"""The records the dispatcher's statements answer (``Statement(..., row=...)``): each
reader names the columns it reads. Statements that return only ids answer them as
values (``scalar``); the claim's own rows are the claimer's."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ..effect import Job

__all__ = ["Taken"]


@dataclass(frozen=True, slots=True)
class Taken:
    """A job in ``reconcile`` the reconciler took to ask about (``reconcile_take``)."""

    id: int
    effect: str
    key: str
    payload: dict[str, Any]
    attempts: int
    claim_version: int
    ordering_key: str | None
    max_attempts: int
    first_attempted_at: datetime | None
    reconcile_checks: int
    created_at: datetime

    def job(self) -> Job:
        """The job as ``reconcile`` is given it (its window from the first attempt, or
        from its creation when none is recorded)."""
        return Job(id=self.id, effect=self.effect, key=self.key, payload=self.payload,
                   attempt=self.attempts, claim_version=self.claim_version,
                   ordering_key=self.ordering_key, max_attempts=self.max_attempts,
                   first_attempted_at=self.first_attempted_at or self.created_at)
