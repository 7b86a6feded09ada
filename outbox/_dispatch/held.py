"""What the dispatcher holds: a claimed job (``Held``) and the outcome of its attempt.

Made by the claimer, carried by the workers, written by the recorder; the provider
limits (``limits``) read the outcomes too. Plain data, below every part.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..effect import Effect, Job

__all__ = ["Held", "Outcome", "Release", "Success", "Undecodable", "decode_payload",
           "read_payload", "undecodable"]

# A payload arrives as jsonb's own text: one value, no whitespace around it, so the
# decoder's scanner alone reads it (``json.loads`` adds checks and two regex scans a job).
decode_payload = json.JSONDecoder().raw_decode


class Undecodable(dict[str, Any]):
    """The payload of a job whose stored JSON Python's reader refuses: jsonb takes an
    integer of any length (through the SQL ``enqueue`` or a trigger), Python's ``int``
    none past 4,300 digits. An empty mapping that carries the reason, so that the job is
    failed with it (``workers.prepare``), never performed, and nothing else stops."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        super().__init__()
        self.reason = reason


def undecodable(error: Exception) -> Undecodable:
    """The payload that stands for one ``decode_payload`` refused with ``error``."""
    return Undecodable(f"{type(error).__name__}: {error}")


def read_payload(text: str) -> Any:
    """A payload from jsonb's text; an ``Undecodable`` if Python cannot read it."""
    try:
        return decode_payload(text)[0]
    except (ValueError, RecursionError) as exc:
        return undecodable(exc)


@dataclass(eq=False, slots=True)
class Held:
    """A job this dispatcher has claimed and not yet recorded."""

    job: Job
    effect: Effect
    is_async: bool
    started: bool = False  # written by the worker that runs it (begin)
    lost: bool = False  # written by the recorder (a heartbeat found the claim gone)
    duration: float = 0.0  # written by the worker: seconds ``perform`` ran
    # Tracing (outbox.tracing): whether it was on at the claim, the enqueue's trace
    # context from the claim, and the attempt's span (written by the worker in begin,
    # ended by the recorder in settled).
    traced: bool = False
    trace_context: Any = None
    span: Any = None
    # The provider's answer (ledger JSON) from an earlier attempt whose completion hook
    # raised: the attempt reuses it instead of performing again (from the claim).
    kept_result: str | None = None


@dataclass(slots=True)  # not frozen: made once per job, on the hot path
class Success:
    """``perform`` returned; its result as JSON text for the ledger."""

    result_json: str


@dataclass(frozen=True, slots=True)
class Release:
    """Not started before shutdown: hand it back with the attempt refunded."""


Outcome = Success | BaseException | Release
