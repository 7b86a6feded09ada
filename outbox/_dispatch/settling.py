"""The claims the fenced writes of ``sql/record.sql`` are given: ``settle``'s, each with
both its decisions, and the plainer ones of the others (``fenced_claims``,
``completion_claims``).

Every caller that settles a claim (the recorder, the completion hooks, the rescuer) builds
its claims here, so that each carries the decision taken for it and the decision for the
same claim had an operator cancelled it before the write
(``_lifecycle.cancelled_meanwhile``): the statement picks one of the two by the row it
reads as it writes, and decides nothing of its own. It answers which it wrote (per job
settled: its id and ``cancelled``), and ``as_written`` and ``reported`` turn that into the
decision written and the outcome reported (counted, observed, traced), so a retry an
operator's cancel turned into a failure is reported failed, as it was written.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from .. import _lifecycle
from .._lifecycle import Decision
from ..effect import Job
from ..observe import AttemptOutcome
from .held import Held, Success

__all__ = ["as_written", "completion_claims", "fenced_claims", "reported", "settle_claim",
           "settle_claims"]

_OBSERVED: dict[str, AttemptOutcome] = {
    "pending": "retry", "failed": "failed", "reconcile": "reconcile", "done": "done",
}


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


def as_written(claim: Mapping[str, Any], *, cancelled: bool) -> Decision:
    """The decision ``settle`` wrote for ``claim`` (``settle_claim``'s) by what it
    answered: ``cancelled``, the one for a claim an operator cancelled between the
    decision and the write (its ``cancelled_*`` fields), else the claim's own. Read from
    the claim sent, so it is what the statement was given, not decided again."""
    if cancelled:
        return Decision(claim["cancelled_status"], delay=claim["cancelled_delay"],
                        error=claim["cancelled_error"])
    return Decision(claim["status"], delay=claim["delay"], error=claim["error"])


def reported(claim: Mapping[str, Any], *, cancelled: bool) -> AttemptOutcome:
    """How the attempt of ``claim`` ended, as ``settle`` wrote it (``as_written``): handed
    back to pending with its attempt refunded, ``released``; else by the status written
    (``retry`` for pending)."""
    status = claim["cancelled_status"] if cancelled else claim["status"]
    if status == "pending" and claim["cancelled_refund" if cancelled else "refund"]:
        return "released"
    return _OBSERVED[status]


def fenced_claims(helds: Iterable[Held]) -> str:
    """The ``claims`` parameter of a fenced statement that needs only each claim
    (``heartbeat``, ``lock_claims``): the JSON array of their
    ``{id, version}``, written as text (no object a job: the recorder's own path)."""
    claims = ",".join(f'{{"id":{h.job.id},"version":{h.job.claim_version}}}' for h in helds)
    return f"[{claims}]"


def recorded_claims(helds: Iterable[Held]) -> str:
    """The ``claims`` parameter of ``recorded_claims``: the JSON array of each claim's
    ``{id, version, key}``; the statement finds a completion's ledger row by its key
    (the ledger's primary key) and fences it on the id and version."""
    claims = ",".join(
        f'{{"id":{h.job.id},"version":{h.job.claim_version},"key":{json.dumps(h.job.key)}}}'
        for h in helds)
    return f"[{claims}]"


def completion_claims(successes: Iterable[tuple[Held, Success]]) -> str:
    """The ``claims`` parameter of ``complete`` and ``complete_delete``: the JSON array of
    each claim's ``{id, version, result}``, the result the outcome's JSON text as is."""
    claims = ",".join(
        f'{{"id":{h.job.id},"version":{h.job.claim_version},"result":{o.result_json}}}'
        for h, o in successes)
    return f"[{claims}]"
