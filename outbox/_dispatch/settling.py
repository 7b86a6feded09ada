"""The claims ``settle`` (``sql/record.sql``) applies, each with both its decisions.

Every caller that settles a claim (the recorder, the completion hooks, the rescuer) builds
its claims here, so that each carries the decision taken for it and the decision for the
same claim had an operator cancelled it before the write
(``_lifecycle.cancelled_meanwhile``): the statement picks one of the two by the row it
reads as it writes, and decides nothing of its own.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from .. import _lifecycle
from .._lifecycle import Decision
from ..effect import Job


def settle_claim(job: Job, decision: Decision, *, refund: bool = False,
                 expired: bool = False) -> dict[str, Any]:
    """One claim of ``settle``: ``job``'s claim settled as ``decision`` (``refund``: its
    attempt given back, a release; ``expired``: the rescuer's, fenced on the lease still
    being expired), and as ``_lifecycle.cancelled_meanwhile`` decides for it should an
    operator have cancelled that claim meanwhile (the ``cancelled_*`` fields)."""
    cancelled = _lifecycle.cancelled_meanwhile(decision, released=refund)
    return {"id": job.id, "version": job.claim_version, "status": decision.status,
            "delay": decision.delay, "error": decision.error, "refund": refund,
            "expired": expired, "cancelled_status": cancelled.status,
            "cancelled_delay": cancelled.delay, "cancelled_error": cancelled.error,
            "cancelled_refund": refund}


def settle_claims(claims: Iterable[dict[str, Any]]) -> str:
    """The ``claims`` parameter of ``settle``: the JSON array of ``settle_claim``'s."""
    return json.dumps(list(claims))
