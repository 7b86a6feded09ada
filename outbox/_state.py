"""Pure decisions of the job lifecycle: what a job's next state is, and when.

No I/O and no clock of its own: callers pass ``now`` and a random source, so every rule
here is tested without a database. The state machine these decisions drive::

    pending --claim--> running --done (+ledger)--> done --retention--> (deleted)
       ^                  |  \\--Permanent / attempts exhausted--> failed
       |                  |  \\--UnknownOutcome past window------> reconcile
       +--Retry/backoff---+
       +--lease expired (rescuer, fenced)
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

from .errors import Permanent, Retry, Throttled, UnknownOutcome

__all__ = ["Backoff", "Decision", "decide", "heartbeat_interval", "seconds"]

Status = Literal["pending", "running", "done", "failed", "reconcile"]
MAX_ERROR_LENGTH = 2000
# The longest retry delay honoured: a Retry-After past a year is a bug or a bogus header,
# and far enough out that now() + delay would leave PostgreSQL's calendar.
MAX_RETRY_DELAY = 365 * 86400.0


def seconds(value: float | timedelta, *, what: str, minimum: float = 0.0) -> float:
    """A duration given as seconds or a timedelta, as float seconds, checked."""
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{what} must be seconds (a number) or a timedelta, got {value!r}")
    if not value >= minimum:  # also rejects NaN
        raise ValueError(f"{what} must be at least {minimum} seconds, got {value}")
    return float(value)


@dataclass(frozen=True, slots=True)
class Backoff:
    """Capped exponential backoff with full jitter.

    The n-th retry waits ``random(0, min(cap, base * 2 ** (n - 1)))`` seconds: full jitter
    spreads a burst of failures out instead of retrying them in lockstep.
    """

    base: float = 1.0
    cap: float = 3600.0

    def delay(self, attempt: int, rng: random.Random) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
        exponent = min(max(attempt - 1, 0), 62)  # 2**62 * base is past any cap already
        return rng.uniform(0.0, min(self.cap, self.base * 2.0**exponent))


@dataclass(frozen=True, slots=True)
class Decision:
    """Where a finished attempt sends the job: the next status, delay and error text."""

    status: Status
    delay: float = 0.0
    error: str | None = None


def heartbeat_interval(lease: float) -> float:
    """How often to extend a lease: three chances before it runs out."""
    return lease / 3.0


def describe(error: BaseException) -> str:
    """The error text stored in ``last_error``: type and message, bounded in length."""
    if isinstance(error, Permanent | Retry | Throttled | UnknownOutcome):
        text = f"{type(error).__name__}: {error.reason}"
    else:
        text = f"{type(error).__name__}: {error}"
    # PostgreSQL text holds neither NUL nor lone surrogates: escape them, or the statement
    # recording the outcome is refused and the outcome lost.
    text = text.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode("utf-8")
    if len(text) > MAX_ERROR_LENGTH:
        text = text[: MAX_ERROR_LENGTH - 3] + "..."
    return text


def decide(
    error: BaseException,
    *,
    attempt: int,
    max_attempts: int,
    first_attempted_at: datetime | None,
    now: datetime,
    unknown_outcome_window: float,
    backoff: Backoff,
    rng: random.Random,
) -> Decision:
    """The next state of a job whose attempt ``attempt`` raised ``error``.

    - ``Permanent``: failed at once.
    - ``UnknownOutcome``: retried with the same key while the provider's idempotency
      window (from the first attempt) lasts and attempts remain; otherwise reconcile,
      because the provider may have acted and re-sending could act again.
    - ``Retry`` and any other exception: retried after ``Retry.after`` or the backoff,
      until ``max_attempts``; then failed with the last error.
    """
    text = describe(error)
    if isinstance(error, Permanent):
        return Decision("failed", error=text)
    if isinstance(error, UnknownOutcome):
        started = first_attempted_at or now
        if now - started >= timedelta(seconds=unknown_outcome_window):
            return Decision("reconcile", error=f"{text} (past the idempotency window)")
        if attempt >= max_attempts:
            return Decision("reconcile", error=f"{text} (attempts exhausted)")
        return Decision("pending", delay=_delay(error.after, attempt, backoff, rng), error=text)
    if attempt >= max_attempts:
        return Decision("failed", error=f"{text} (attempt {attempt} of {max_attempts})")
    after = error.after if isinstance(error, Retry | Throttled) else None
    return Decision("pending", delay=_delay(after, attempt, backoff, rng), error=text)


def _delay(after: float | None, attempt: int, backoff: Backoff, rng: random.Random) -> float:
    """``after`` when given and sane, capped at MAX_RETRY_DELAY; else the backoff."""
    if after is None or math.isnan(after):
        return backoff.delay(attempt, rng)
    return min(max(after, 0.0), MAX_RETRY_DELAY)
