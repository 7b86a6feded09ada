"""Pure decisions of the job lifecycle: what a job's next state is, and when.

``settle`` is the one settlement of an attempt (the recorder and the completion hooks
call it), ``expired`` the one of a claim whose lease ran out (the rescuer calls it: an
unknown outcome, settled by ``settle``), ``settle_answer`` the one of a reconciler's
answer (the reconciler calls it). ``TRANSITIONS`` lists every status change a job can
make, with the statement that applies it (the docs' table is tested against it).

No I/O and no clock of its own: callers pass ``now`` and a random source, so every rule
here is tested without a database. The state machine these decisions drive::

    pending --claim--> running --done (+ledger)--> done --retention--> (deleted)
       ^                  |  \\--Permanent / attempts exhausted--> failed
       |                  |  \\--UnknownOutcome past window------> reconcile
       +--Retry/backoff---+
       +--lease expired (rescuer, fenced): an UnknownOutcome, settled as one

    reconcile --asked: performed (+ledger)--> done
              --asked: not performed-------> pending (same key, fresh window)
              --asked: Permanent-----------> failed
              --asked: unknown-------------> reconcile (asked again later, or left to a
                                             person after MAX_UNKNOWN_PASSES answers)
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal, Protocol

from .errors import Permanent, Retry, Throttled, UnknownOutcome

__all__ = ["ACTS_ON", "MAX_ASK_DELAY", "MAX_UNKNOWN_PASSES", "NEVER", "NULLABLE_FACTS",
           "PARENT_SETTLED", "RELEASED", "TRANSITIONS", "Action", "Answered", "AtMost",
           "Attempted", "Backoff", "Condition", "Decision", "Equals", "ErrorPart", "Fact",
           "Given", "Mode", "ParentCase", "Quoted", "Released", "Rules", "Said", "Settled",
           "Told", "Transition", "after_told", "cancelled_meanwhile", "check_parent_rule",
           "expired", "heartbeat_interval", "lease_expired", "next_ask", "operator_action",
           "parent_settled", "seconds", "settle", "settle_answer"]

Status = Literal["pending", "running", "done", "failed", "reconcile"]
MAX_ERROR_LENGTH = 2000
# The longest retry delay honoured: a Retry-After past a year is a bug or a bogus header,
# and far enough out that now() + delay would leave PostgreSQL's calendar.
MAX_RETRY_DELAY = 365 * 86400.0


# The longest duration an option takes: a century. Past it no setting makes sense, and
# now() plus it must stay inside PostgreSQL's and Python's calendars (a lease of 1e300 s
# made every claim fail with a datetime overflow, the job never claimed).
MAX_DURATION = 100 * 365.25 * 86400.0


def shown_number(value: object) -> str:
    """``value`` as a refusal quotes it: its repr, or for an integer too long to read
    (past 128 bits; Python will not even print one past 4,300 digits) its size."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() >= 128:
        return f"an integer of {value.bit_length()} bits"
    return repr(value)


def seconds(value: float | timedelta, *, what: str, minimum: float = 0.0) -> float:
    """A duration given as seconds or a timedelta, as float seconds, checked: at least
    ``minimum``, at most ``MAX_DURATION`` (a century; infinity is refused too)."""
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{what} must be seconds (a number) or a timedelta, got {value!r}")
    if not value >= minimum:  # also rejects NaN
        raise ValueError(f"{what} must be at least {minimum} seconds, got {value}")
    if not value <= MAX_DURATION:
        raise ValueError(f"{what} must be at most a century ({MAX_DURATION:.0f} seconds), "
                         f"got {shown_number(value)}")
    return float(value)


@dataclass(frozen=True, slots=True)
class Backoff:
    """Capped exponential backoff with full jitter.

    The n-th retry waits ``random(0, min(cap, base * 2 ** (n - 1)))`` seconds: full jitter
    spreads a burst of failures out instead of retrying them in lockstep.

    :param base: Seconds: the first retry waits up to this long, each next one up to
        twice as long.
    :param cap: Seconds: no retry waits longer.
    :raises ValueError: ``base`` or ``cap`` not a number of seconds from 0 to a year.
    """

    base: float = 1.0
    cap: float = 3600.0

    def __post_init__(self) -> None:
        # Checked here, not at the first retry: a NaN or a cap past a year made the
        # next attempt's time a value PostgreSQL refuses, and the settlement failed.
        for name in ("base", "cap"):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, int | float)
                    or not 0 <= value <= MAX_RETRY_DELAY):
                raise ValueError(f"Backoff {name} must be seconds from 0 to a year "
                                 f"({MAX_RETRY_DELAY:.0f}), got {value!r}")

    def delay(self, attempt: int, rng: random.Random) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
        exponent = min(max(attempt - 1, 0), 62)  # 2**62 * base is past any cap already
        return rng.uniform(0.0, min(self.cap, self.base * 2.0**exponent))


@dataclass(frozen=True, slots=True)
class Decision:
    """Where a transition sends the job: the next status, delay and error text (None:
    the error it has is kept), and what else the statement applying it writes.

    :var attempts: The attempts the job counts from now on (None: as they are; 0: a
        fresh attempt budget).
    :var fresh_window: The first attempt is forgotten (``first_attempted_at`` cleared):
        the provider's idempotency window counts again from the next attempt.
    :var ledger: A ledger row is written with the status (done): the key is never
        performed again.
    :var stop: The job's current claim is asked to stop (an operator's cancel of a
        running job): its status stays, its dispatcher settles what its perform did.
    :var clear_error: ``last_error`` is cleared (``error`` is then None).
    :var waive_parents: A job waiting on its parents (``after=[...]``) waits no more.
    """

    status: Status
    delay: float = 0.0
    error: str | None = None
    attempts: int | None = None
    fresh_window: bool = False
    ledger: bool = False
    stop: bool = False
    clear_error: bool = False
    waive_parents: bool = False


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


class Attempted(Protocol):
    """The facts about a job's attempt that settle it (``outbox.Job`` has them)."""

    @property
    def attempt(self) -> int: ...

    @property
    def max_attempts(self) -> int: ...

    @property
    def first_attempted_at(self) -> datetime | None: ...


@dataclass(frozen=True, slots=True)
class Rules:
    """What settles an effect's attempts besides their outcome.

    ``window``: seconds the provider remembers an idempotency key, counted from the first
    attempt; ``backoff``: the delay between retries; ``reconciles``: the effect defines
    ``reconcile``, so an unknown outcome is asked about before the window closes.
    """

    window: float = math.inf
    backoff: Backoff = Backoff()
    reconciles: bool = False


@dataclass(frozen=True, slots=True)
class Released:
    """The outcome of an attempt handed back unstarted (shutdown): no attempt was spent."""


RELEASED = Released()

Settled = BaseException | Released | None
"""What ``settle`` settles: the exception ``perform`` raised, ``RELEASED``, or None for a
``perform`` that returned (settled by ``settle`` only when its hook raised)."""


def settle(
    outcome: Settled,
    job: Attempted,
    rules: Rules,
    *,
    now: datetime,
    rng: random.Random,
    hook_error: BaseException | None = None,
    told: Told | None = None,
) -> Decision:
    """The next state of ``job`` after its attempt ended with ``outcome`` (and, when the
    completion hook of that outcome raised, ``hook_error``; ``told``: why its perform was
    told to stop, ``job.cancelled.reason``, if it was). The one settlement of an attempt:
    the recorder and the completion hooks both call it.

    - returned: done. Released: pending at once, no error. ``Throttled``: pending at
      once (the effect's pause keeps it from being claimed early).
    - ``Permanent``: failed at once.
    - ``UnknownOutcome``: retried with the same key while the provider's idempotency
      window (from the first attempt) lasts and attempts remain; otherwise reconcile,
      because the provider may have acted and re-sending could act again. For an effect
      that ``reconciles``, also reconcile when the next retry would come after the
      window closes: the provider is asked while re-sending the key is still safe.
    - ``Retry`` and any other exception: retried after ``Retry.after`` or the backoff,
      until ``max_attempts``; then failed with the last error.
    - a hook that raised: retried with backoff until ``max_attempts`` (``Permanent`` from
      the hook: at once), then failed. Never reconcile: the provider's outcome is known,
      only the hook failed. The error names the hook (``on_done`` after a returned
      ``perform``, else ``on_failed`` after the failure it was told of).
    - told to stop (``told``) and returned: done, as above (it acted). Told and raised:
      see ``after_told`` (an operator's cancel: failed, or reconcile for an effect that
      reconciles; any other reason: an unknown outcome unless the effect raised its
      own verdict).
    """
    if hook_error is not None:
        return _after_hook(outcome, hook_error, job, rules, now=now, rng=rng)
    if outcome is None:
        return Decision("done")
    if told is not None:
        told_outcome = after_told(outcome, told, rules)
        if isinstance(told_outcome, Decision):
            return told_outcome
        outcome = told_outcome
    return _after_outcome(outcome, job, rules, now=now, rng=rng)


def lease_expired(job: Attempted, worker: str | None) -> UnknownOutcome:
    """The outcome of an attempt whose lease ran out: unknown, since the worker that
    held it (``worker``, ``claimed_by``) may have called the provider before it died or
    stalled."""
    return UnknownOutcome(f"lease expired on attempt {job.attempt} of {job.max_attempts} "
                          f"(worker {worker or 'unknown'} stopped heartbeating)")


def expired(job: Attempted, rules: Rules, *, now: datetime, rng: random.Random,
            worker: str | None = None, cancelled: bool = False) -> Decision:
    """The next state of ``job`` whose claim's lease expired (the rescuer's decision;
    ``worker``: who held it; ``cancelled``: an operator cancelled that claim).

    Exactly ``settle`` of an ``UnknownOutcome`` (``lease_expired``), told ``"operator"``
    when ``cancelled``: retried with the same key after the backoff while the window
    lasts and attempts remain; else reconcile (attempts used up, past the window, or,
    for an effect that reconciles, a next retry after the window closes); an operator's
    cancel ends failed, or reconcile for an effect that reconciles.
    """
    return settle(lease_expired(job, worker), job, rules, now=now, rng=rng,
                  told="operator" if cancelled else None)


def _after_outcome(outcome: BaseException | Released, job: Attempted, rules: Rules, *,
                   now: datetime, rng: random.Random) -> Decision:
    """``settle`` for an attempt that did not return (the rules in its docstring)."""
    if isinstance(outcome, Released):
        return Decision("pending")
    if isinstance(outcome, Throttled):
        return Decision("pending", error=describe(outcome))
    decision = _after_error(outcome, job, rules, now=now, rng=rng)
    if rules.reconciles:
        return _ask_before_window_closes(decision, outcome, job, rules.window, now)
    return decision


Told = Literal["operator", "lost", "lease", "timeout", "stop", "set"]
"""Why a perform was told to stop (``job.cancelled.reason``): see ``outbox._cancelling``."""

_TOLD = {"lost": "its claim was taken over", "lease": "its lease expired",
         "timeout": "its effect's timeout passed", "stop": "the dispatcher stopped",
         "set": "job.cancelled was set"}


def after_told(outcome: BaseException | Released, told: Told,
               rules: Rules) -> Decision | BaseException | Released:
    """What an attempt told to stop (``told``) that did not return settles as: a
    decision, or the outcome ``settle`` goes on with.

    - an operator's cancel: failed, never performed when it had not started; else
      failed ("cancelled while running"; it may have acted), or, for an effect that
      reconciles, reconcile, so that the provider is asked whether it acted (the answer
      "not performed" then ends it failed too, never pending).
    - any other reason: a perform that raised may have acted, so an exception other than
      the effect's own verdict (``Permanent``, ``Retry``, ``UnknownOutcome``,
      ``Throttled``) is an ``UnknownOutcome``: retried with the same key within the
      window, else reconcile. Released (never started) stays released.
    """
    if told == "operator":
        if isinstance(outcome, Released):
            return Decision("failed", error="cancelled by an operator before it started: "
                                            "never performed")
        text = f"cancelled by an operator while running ({describe(outcome)})"
        if rules.reconciles:
            return Decision("reconcile", error=f"{text}: the provider is asked whether it "
                                               "acted")
        return Decision("failed", error=f"{text}; it may have acted before it stopped")
    if isinstance(outcome, Released | Permanent | Retry | UnknownOutcome | Throttled):
        return outcome
    return UnknownOutcome(f"told to stop ({_TOLD[told]}), then raised {describe(outcome)}")


def cancelled_meanwhile(decision: Decision, *, released: bool = False) -> Decision:
    """What is written instead of ``decision`` (``settle``'s or ``expired``'s, for an
    attempt that ended untold, or a release: ``released``) when an operator cancelled its
    claim after it was decided and before it was written. Decided with ``decision``, up
    front: the settling statement picks one of the two by what it reads as it writes (the
    row's ``cancel_version`` equal to its ``claim_version``), with no rule of its own.

    - pending (a retry, ``Throttled``, a release): failed, never back to pending (the
      cancel stands, as ``after_told``'s): a release "cancelled by an operator before it
      started: never performed"; any other "cancelled by an operator while running", with
      the decided error after it. Due as it was (``delay`` 0: a failed job is never due).
    - any other decision (failed, reconcile): as decided; the cancel changes nothing.
    """
    if decision.status != "pending":
        return decision
    if released:
        return Decision("failed", error="cancelled by an operator before it started: "
                                        "never performed")
    note = "" if decision.error is None else f": {decision.error}"
    return Decision("failed", error=f"cancelled by an operator while running{note}")


def _after_error(error: BaseException, job: Attempted, rules: Rules, *, now: datetime,
                 rng: random.Random) -> Decision:
    """``settle`` for an attempt that raised ``error`` (the rules in its docstring)."""
    text = describe(error)
    attempt, max_attempts = job.attempt, job.max_attempts
    if isinstance(error, Permanent):
        return Decision("failed", error=text)
    if isinstance(error, UnknownOutcome):
        started = job.first_attempted_at or now
        if _past(started, rules.window, now):
            return Decision("reconcile", error=f"{text} (past the idempotency window)")
        if attempt >= max_attempts:
            return Decision("reconcile", error=f"{text} (attempts exhausted)")
        return Decision("pending", delay=_delay(error.after, attempt, rules.backoff, rng),
                        error=text)
    if attempt >= max_attempts:
        return Decision("failed", error=f"{text} (attempt {attempt} of {max_attempts})")
    after = error.after if isinstance(error, Retry | Throttled) else None
    return Decision("pending", delay=_delay(after, attempt, rules.backoff, rng), error=text)


def _ask_before_window_closes(decision: Decision, error: BaseException, job: Attempted,
                              window: float, now: datetime) -> Decision:
    """An unknown outcome whose next retry would come after the provider forgets the key
    goes to reconcile now, instead of being sent again past the provider's memory."""
    if decision.status != "pending" or not isinstance(error, UnknownOutcome):
        return decision
    if not _past(job.first_attempted_at or now, window - decision.delay, now):
        return decision
    return Decision("reconcile", error=f"{decision.error} (the window closes before the "
                                       "next attempt: the provider is asked instead)")


def _past(started: datetime, window: float, now: datetime) -> bool:
    """Whether ``window`` seconds from ``started`` have passed at ``now`` (an infinite
    window never passes; a negative one always has)."""
    if math.isinf(window):
        return window < 0
    return now - started >= timedelta(seconds=window)


def _after_hook(outcome: Settled, hook_error: BaseException, job: Attempted, rules: Rules,
                *, now: datetime, rng: random.Random) -> Decision:
    """``settle`` for an outcome whose completion hook raised ``hook_error``."""
    if outcome is None or isinstance(outcome, Released):
        text = f"on_done raised {describe(hook_error)}"
    else:
        told = _after_error(outcome, job, rules, now=now, rng=rng).error
        text = f"{told}; on_failed raised {describe(hook_error)}"
    if isinstance(hook_error, Permanent) or job.attempt >= job.max_attempts:
        return Decision("failed", error=text)
    return Decision("pending", delay=rules.backoff.delay(job.attempt, rng), error=text)


Answered = Literal["performed", "not_performed", "failed", "unknown", "unreachable"]
"""What a reconciler learnt about a job in reconcile: the provider did act, did not, the
job can never succeed (``Permanent``), the provider does not know yet (``None``), or it
could not be asked (anything else raised)."""

MAX_UNKNOWN_PASSES = 8
"""Answers of "still unknown" before the reconciler gives up and a person decides."""
MAX_ASK_DELAY = 6 * 3600.0
"""The longest wait between two asks about one job."""
NEVER = math.inf
"""The delay of a job the reconciler gave up on: it is not asked about again."""


def next_ask(interval: float, answered: int, rng: random.Random) -> float | None:
    """Seconds until the next ask after ``answered`` answers of "still unknown" (None:
    never again). Doubling from ``interval``, capped, with jitter so that a backlog
    spreads out."""
    if answered >= MAX_UNKNOWN_PASSES:
        return None
    return min(MAX_ASK_DELAY, interval * 2.0 ** answered) * rng.uniform(0.75, 1.0)


def settle_answer(answer: Answered, *, error: BaseException | None = None,
                  hook_error: BaseException | None = None, checks: int = 0,
                  interval: float = 60.0, rng: random.Random | None = None,
                  cancelled: bool = False) -> Decision:
    """The next state of a job in ``reconcile`` once its provider answered ``answer``
    (``error``: what ``reconcile`` raised), and its hook, if any, ran; ``checks``: the
    answers of "still unknown" before this one; ``interval``: the first wait between
    asks. The one settlement of a reconciler's answer.

    - performed: done with the provider's result; if ``on_done`` raised, pending with
      the answer kept (the next attempt runs the hook, not the effect).
    - not performed: pending, same key, a fresh attempt budget and a fresh window (as
      an operator's retry); for a job an operator cancelled while it ran
      (``cancelled``), failed: it never acted, and the cancel stands.
    - failed (``Permanent`` raised by ``reconcile``): failed; an ``on_failed`` that
      raised is noted in the error, the failure stands.
    - unknown: still reconcile, asked again after ``next_ask``; after
      ``MAX_UNKNOWN_PASSES`` such answers, given up (delay ``NEVER``): a person decides.
    - unreachable: still reconcile, asked again the same way, the pass not counted
      toward giving up.
    """
    if answer == "performed":
        if hook_error is None:
            return Decision("done", ledger=True, clear_error=True)
        return Decision("pending", error=f"on_done raised {describe(hook_error)}",
                        attempts=0)
    if answer == "not_performed":
        return _not_performed(cancelled=cancelled)
    if answer == "failed":
        text = describe(error) if error is not None else "reconciler: failed"
        if hook_error is not None:
            text = f"{text}; on_failed raised {describe(hook_error)}"
        return Decision("failed", error=text)
    answered = checks + (answer == "unknown")
    delay = next_ask(interval, answered, rng or random.Random())
    if delay is not None:
        return Decision("reconcile", delay=delay)
    note = (describe(error) if error is not None
            else f"reconciler: still unknown after {checks + 1} answer(s)")
    return Decision("reconcile", delay=NEVER, error=f"reconciler gave up: {note}")


def _not_performed(*, cancelled: bool) -> Decision:
    """``settle_answer`` for an answer of "not performed" (the rules in its docstring)."""
    if cancelled:
        return Decision("failed", error="cancelled by an operator while running; the "
                        "provider has no trace of it: never performed", attempts=0,
                        fresh_window=True)
    return Decision("pending", error="reconciler: the provider has no trace of this "
                                     "key; performing again", attempts=0, fresh_window=True)


Action = Literal["retry", "cancel", "resolve_done", "resolve_failed"]
"""What an operator asks of one job (``outbox retry``, ``cancel``, ``resolve``, the
dashboard's buttons; a bulk retry is a retry of each failed job it selects)."""

ACTS_ON: dict[Action, tuple[Status, ...]] = {
    "retry": ("failed", "reconcile"),
    "cancel": ("pending", "running"),
    "resolve_done": ("reconcile",),
    "resolve_failed": ("reconcile",),
}
"""The statuses each operator action applies to; on any other it changes nothing."""


def operator_action(action: Action, status: str, *, last_error: str | None, actor: str,
                    via: str) -> Decision | None:
    """The next state of a job in ``status`` (with ``last_error``, as read) that
    ``actor`` acts on through ``via`` (``"dashboard"``, ``"command line"``); None: the
    action does not apply to that status, nothing is written. The one decision of an
    operator's action, applied fenced on the status and claim_version it was read with.

    - retry (failed or reconcile): pending now, a fresh attempt budget and a fresh
      idempotency window (same key), no more waiting on parents; the last error kept.
    - cancel: a pending job failed, never performed; a running one stays running and
      its claim is asked to stop (``stop``): its dispatcher settles what the perform did
      (``after_told``).
    - resolve_done (reconcile): done with a ledger row naming the person, the key never
      performed again; the error cleared.
    - resolve_failed (reconcile): failed, the error naming the person.
    """
    if status not in ACTS_ON[action]:
        return None
    if action == "retry":
        return Decision("pending", attempts=0, fresh_window=True, waive_parents=True)
    if action == "cancel":
        if status == "running":
            return Decision("running", stop=True)
        return Decision("failed", error=f"cancelled from the {via} by {actor}")
    if action == "resolve_done":
        return Decision("done", ledger=True, clear_error=True)
    note = "" if last_error is None else f": {last_error}"
    return Decision("failed", error=f"resolved as not performed by {actor}{note}")


Mode = Literal["fail", "run"]
"""What a parent failing for good does to a child (``after_failed``)."""
PARENT_ERROR_LENGTH = 200
"""The characters of a failed parent's ``last_error`` a child's error quotes."""

Fact = Literal["mode", "waiting", "settled", "failed", "failed_error"]
"""What a parent's settlement decides a child with (``parent_settled``'s arguments): its
``after_failed`` (``mode``), the parents it waits on (``waiting``), how many of them were
settled for good at once (``settled``), the least key among those that failed
(``failed``; None: all done) and that parent's ``last_error`` (``failed_error``)."""
NULLABLE_FACTS: frozenset[Fact] = frozenset({"failed", "failed_error"})
"""The facts that may be None (in SQL: NULL): a condition or an error names them only as
``Given``, ``Quoted``, or, once ``Given`` holds in its case, as ``Said``."""


@dataclass(frozen=True, slots=True)
class Given:
    """Holds when the fact ``fact`` is not None (a parent failed: ``Given("failed")``)."""

    fact: Fact


@dataclass(frozen=True, slots=True)
class Equals:
    """Holds when the fact ``fact`` (never None) equals ``value``."""

    fact: Fact
    value: str | int


@dataclass(frozen=True, slots=True)
class AtMost:
    """Holds when the fact ``fact`` is at most the fact ``other`` (both numbers, never
    None): ``AtMost("waiting", "settled")``, the last parent settled."""

    fact: Fact
    other: Fact


Condition = Given | Equals | AtMost


@dataclass(frozen=True, slots=True)
class Said:
    """A part of an error: the fact ``fact``, as text."""

    fact: Fact


@dataclass(frozen=True, slots=True)
class Quoted:
    """A part of an error: nothing when the fact ``fact`` is None, else ``before``, its
    first ``limit`` characters, ``after``."""

    fact: Fact
    before: str
    after: str
    limit: int


ErrorPart = str | Said | Quoted


@dataclass(frozen=True, slots=True)
class ParentCase:
    """One case of the rule of a parent's settlement: when every condition of ``when``
    holds (an empty ``when``: always), the child's next ``status``, its ``delay`` (0: due
    now; ``NEVER``: still waiting, its ``available_at`` as it stands) and its error (the
    parts of ``error`` joined; None: the error it has is kept). ``means`` says it in
    words."""

    when: tuple[Condition, ...]
    status: Status
    delay: float
    error: tuple[ErrorPart, ...] | None
    means: str


PARENT_SETTLED: tuple[ParentCase, ...] = (
    ParentCase((Given("failed"), Equals("mode", "fail")), "failed", 0.0,
               ("not performed: parent ", Said("failed"), " failed for good",
                Quoted("failed_error", " (", ")", PARENT_ERROR_LENGTH)),
               "a parent failed and the child says after_failed='fail': failed, never "
               "performed, the error naming the parent's key (and the start of its error)"),
    ParentCase((AtMost("waiting", "settled"),), "pending", 0.0, None,
               "else, its last parent settled: pending and due now"),
    ParentCase((), "pending", NEVER, None, "else: pending, still waiting on the others"),
)
"""The rule of a parent's settlement, as data: its cases in order, the first that holds
decides. Written here once: ``parent_settled`` evaluates it, and the fragment
``after_released`` (``sql/after.sql``), which applies it to every child of the parents a
statement settles, gets its CASE expressions rendered from it (``outbox._rule_sql``) when
the SQL is loaded, so the two cannot differ."""


def check_parent_rule(rule: tuple[ParentCase, ...]) -> tuple[ParentCase, ...]:
    """``rule``, if each of its facts is named as its kind allows (``NULLABLE_FACTS``) and
    its last case holds always (so one always decides); else ``ValueError`` saying which
    case is wrong."""
    if not rule or rule[-1].when:
        raise ValueError("the rule's last case must hold always (when=()), so that one "
                         "case decides every child")
    for index, case in enumerate(rule):
        given = {c.fact for c in case.when if isinstance(c, Given)}
        named = [c.fact for c in case.when if isinstance(c, Equals)]
        named += [f for c in case.when if isinstance(c, AtMost) for f in (c.fact, c.other)]
        named += [p.fact for p in case.error or () if isinstance(p, Said)
                  and p.fact not in given]
        nullable = sorted(set(named) & NULLABLE_FACTS)
        if nullable:
            raise ValueError(f"case {index} of the rule ({case.means}) compares or says "
                             f"{nullable}, which may be None: test them with Given first")
    return rule


check_parent_rule(PARENT_SETTLED)


def parent_settled(mode: Mode, waiting: int, failed: str | None,
                   failed_error: str | None = None, *, settled: int = 1,
                   rule: tuple[ParentCase, ...] = PARENT_SETTLED) -> Decision:
    """The next state of a pending child waiting on ``waiting`` parents (``mode``: its
    ``after_failed``) once ``settled`` of them were settled for good in one statement;
    ``failed``: the least key among those that failed (None: all done), with its
    ``last_error``. The one decision of a parent's settlement (and of a child enqueued
    after parents settled already: ``waiting`` is then how many it names): the first case
    of ``rule`` (``PARENT_SETTLED``) that holds.

    - a parent failed and the child says ``"fail"``: failed, never performed, the error
      naming the parent's key (and the start of its error).
    - else, its last parent settled: pending and due now (delay 0).
    - else: pending, still waiting on the others (delay ``NEVER``).

    At enqueue, ``outbox._after.link_steps`` calls it for each child and ``after_link``
    writes its decision. When a parent settles, the fragment ``after_released``
    (``sql/after.sql``, bound into every settlement, set-based: one statement however
    many children) applies the same cases, rendered as SQL from ``rule``, and a test runs
    it against this function for every case.
    """
    facts: dict[Fact, str | int | None] = {"mode": mode, "waiting": waiting,
                                           "settled": settled, "failed": failed,
                                           "failed_error": failed_error}
    for case in rule:
        if all(_holds(condition, facts) for condition in case.when):
            error = (None if case.error is None
                     else "".join(_said(part, facts) for part in case.error))
            return Decision(case.status, delay=case.delay, error=error)
    raise ValueError("no case of the rule holds (its last must hold always)")


def _holds(condition: Condition, facts: dict[Fact, str | int | None]) -> bool:
    if isinstance(condition, Given):
        return facts[condition.fact] is not None
    if isinstance(condition, Equals):
        return facts[condition.fact] == condition.value
    value, other = facts[condition.fact], facts[condition.other]
    assert isinstance(value, int) and isinstance(other, int)
    return value <= other


def _said(part: ErrorPart, facts: dict[Fact, str | int | None]) -> str:
    if isinstance(part, str):
        return part
    value = facts[part.fact]
    if isinstance(part, Said):
        return str(value)
    return "" if value is None else f"{part.before}{str(value)[:part.limit]}{part.after}"


def _delay(after: float | None, attempt: int, backoff: Backoff, rng: random.Random) -> float:
    """``after`` when given and sane, capped at MAX_RETRY_DELAY; else the backoff."""
    if after is None or math.isnan(after):
        return backoff.delay(attempt, rng)
    return min(max(after, 0.0), MAX_RETRY_DELAY)


Source = Literal["enqueue", "claim", "settle", "rescue", "hook", "reconcile", "operator",
                 "cancel", "parent", "event", "retention"]
"""Who moves a job: the enqueue, the claimer, the recorder settling an attempt, the
rescuer, a completion hook that raised, the reconciler, an operator (``outbox retry``,
``resolve``, the dashboard), an operator's cancel, a parent's failure (fan-in), a
provider's event (``resolve_by_event``), retention."""


@dataclass(frozen=True, slots=True)
class Transition:
    """One status change: ``source`` moves a job from ``before`` to ``after`` (None: the
    row is deleted) when ``when`` holds, decided by ``decided_by`` (a function of this
    module; "SQL": the statement's own condition, a rule with no outcome to weigh: the
    claim, a provider's event, retention) and applied by the named statement or fragment
    ``statement`` (``outbox/sql/*.sql``), fenced on the status it starts from."""

    source: Source
    before: Status
    after: Status | None
    when: str
    decided_by: str
    statement: str


def _t(source: Source, before: Status, after: Status | None, when: str, decided_by: str,
       statement: str) -> Transition:
    return Transition(source, before, after, when, decided_by, statement)


TRANSITIONS: tuple[Transition, ...] = (
    _t("claim", "pending", "running", "due; its group and ordering key free", "SQL",
       "claim_taken"),
    _t("settle", "running", "done", "perform returned (+ ledger row)", "settle", "complete"),
    _t("settle", "running", None, "perform returned, retention 0 (+ ledger row)", "settle",
       "complete_delete"),
    _t("settle", "running", "pending", "Retry, an error or UnknownOutcome with attempts and "
       "window left (backoff); Throttled; released at a stop", "settle", "settle"),
    _t("settle", "running", "failed", "Permanent, or attempts used up", "settle", "settle"),
    _t("settle", "running", "reconcile", "UnknownOutcome past the window or with attempts "
       "used up", "settle", "settle"),
    _t("rescue", "running", "pending", "lease expired, attempts and window left (backoff)",
       "expired", "settle"),
    _t("rescue", "running", "reconcile", "lease expired, attempts used up or past the window",
       "expired", "settle"),
    _t("rescue", "running", "failed", "lease expired on a claim an operator cancelled",
       "expired", "settle"),
    _t("hook", "running", "pending", "on_done raised, attempts left (the result kept)",
       "settle", "keep_result"),
    _t("hook", "running", "failed", "on_done raised on the last attempt", "settle",
       "fail_performed"),
    _t("reconcile", "reconcile", "done", "the provider acted (+ ledger row)",
       "settle_answer", "reconcile_done"),
    _t("reconcile", "reconcile", "pending", "the provider acted, on_done raised (the result "
       "kept)", "settle_answer", "reconcile_keep"),
    _t("reconcile", "reconcile", "pending", "the provider has no trace (a fresh window)",
       "settle_answer", "reconcile_not_performed"),
    _t("reconcile", "reconcile", "failed", "no trace of a job an operator cancelled",
       "settle_answer", "reconcile_not_performed"),
    _t("reconcile", "reconcile", "failed", "reconcile raised Permanent", "settle_answer",
       "reconcile_fail"),
    _t("operator", "failed", "pending", "retry (attempts reset)", "operator_action",
       "operator_apply"),
    _t("operator", "reconcile", "pending", "retry (attempts reset)", "operator_action",
       "operator_apply"),
    _t("operator", "failed", "pending", "retry of every failed job of a filter",
       "operator_action", "bulk_retry"),
    _t("operator", "reconcile", "done", "resolved: performed (+ ledger row)",
       "operator_action", "operator_apply"),
    _t("operator", "reconcile", "failed", "resolved: not performed", "operator_action",
       "operator_apply"),
    _t("cancel", "pending", "failed", "cancelled before it started", "operator_action",
       "operator_apply"),
    _t("cancel", "running", "failed", "cancelled while running: told to stop, its outcome "
       "then settled (reconcile for an effect that reconciles)", "after_told", "settle"),
    _t("cancel", "running", "failed", "cancelled after its outcome was decided a retry or a "
       "release, before that was written", "cancelled_meanwhile", "settle"),
    _t("parent", "pending", "failed", "a parent failed, the child says after_failed='fail'",
       "parent_settled", "after_released"),
    _t("parent", "pending", "failed", "enqueued after a parent that had failed, "
       "after_failed='fail'", "parent_settled", "after_link"),
    _t("event", "reconcile", "pending", "the provider's event says it acted (the result "
       "kept)", "SQL", "resolve_by_event"),
    _t("enqueue", "pending", None, "created by an enqueue_many sent in parts whose later "
       "part was refused, in the same transaction", "SQL", "enqueue_withdrawn"),
    _t("retention", "done", None, "older than retention", "SQL", "purge_done"),
)
"""Every status change a job makes, one row each (the docs' table of transitions in
``docs/explanation/failure-windows.md`` is tested against it)."""
