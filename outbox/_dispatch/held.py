"""What the dispatcher holds: a claimed job (``Held``) and the outcome of its attempt.

Made by the claimer, carried by the workers, written by the recorder; the provider
limits (``limits``) read the outcomes too. Plain data, below every part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..effect import Effect, Job

__all__ = ["Held", "Outcome", "Release", "Success"]


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
