"""Provider limits in the dispatcher (``outbox.limits`` declares them; this is how they
are spent): budgeted claims, throttles, the breaker.

The state is shared through the table ``effect_limits`` (migration 0006), so every
dispatcher process on the schema counts the same budget and sees the same pauses. This
module holds the dispatcher's side of it, written once as steps (``outbox._steps``):

    claimer   ``LimitedClaims.refresh`` reads the state of its effects each round;
              effects with no row gating them are claimed by the core claim as before,
              the others one by one through ``limit_claim`` (the budget is spent in the
              claim's own transaction)
    workers   ``LimitView.paused`` tells a worker not to start a job of an effect this
              process knows to be paused (it is handed back, its attempt refunded)
    recorder  ``report`` writes what the outcomes say about the provider: throttles
              (pause, cut the rate) and transient failures in a row (the breaker)
    home      a limit shared across targets (``Limit(shared=True)``) takes its tokens
              from the limits home before the claim and gives back what it did not use;
              a throttle seen here pauses it there (``outbox._dispatch.shared``)

The view is this process's copy, refreshed each claim round and updated at once by what
its own workers and recorder see; every decision that matters (the budget, the pause,
the probe) is taken again by a locked statement in the database.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg

from .._steps import Rows, Statement, Step
from ..errors import EffectOutcome, Retry, Throttled, UnknownOutcome
from ..limits import Limit
from .held import Success
from .settings import Settings, text_array
from .shared import HOME_RETRY, Grant, HomeBudget, HomeCall, home_budget
from .turns import GroupTurns

if TYPE_CHECKING:
    from .rescuer import RescueHooks

__all__ = [
    "BREAKER_MAX_PAUSE",
    "BREAKER_PAUSE",
    "BREAKER_THRESHOLD",
    "ClaimStep",
    "LimitView",
    "LimitedClaims",
    "is_transient",
    "report",
]

log = logging.getLogger("outbox.dispatcher")

# The breaker: this many transient failures of an effect in a row open it; it then pauses
# the effect for BREAKER_PAUSE seconds, doubled at each opening in a row up to
# BREAKER_MAX_PAUSE, after which one probe job tests recovery.
BREAKER_THRESHOLD = 5
BREAKER_PAUSE = 1.0
BREAKER_MAX_PAUSE = 15.0
T = TypeVar("T")
ClaimStep = Generator["Statement | HomeCall | RescueHooks", Any, T]
"""A claimer's step: statements on its connection, calls to the limits home, and the
rescue's hooks."""

# How long a worker keeps an effect paused on its own after a throttle with no Retry-After,
# before the shared state (written by the recorder) says more.
LOCAL_THROTTLE_PAUSE = 1.0


@dataclass
class LimitView:
    """What this process knows of the shared limit state. Written by the claimer (each
    round), the recorder (from its statements' replies) and workers (a throttle they
    saw); single-key dict writes, safe under the GIL."""

    # effect -> monotonic time its pause ends, and why: as the database says ...
    paused_until: dict[str, float] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    # ... and as this process's own workers saw (a throttle, or failures in a row, not
    # yet written for all)
    local_until: dict[str, float] = field(default_factory=dict)
    local_failures: dict[str, int] = field(default_factory=dict)
    threshold: int | None = BREAKER_THRESHOLD
    # effects with transient failures counted or a breaker open: a success is reported
    troubled: set[str] = field(default_factory=set)
    # Effects limited per group: a throttle pauses the refused job's group only, here
    # until the monotonic time in group_until ((effect, group) -> time; '' for no group).
    per_group: frozenset[str] = frozenset()
    group_until: dict[tuple[str, str], float] = field(default_factory=dict)
    # Effects whose limit is shared across targets, and their home: a throttle seen here
    # is told to the home at once (on a thread of its own: a worker must not wait for
    # it), so that every target sharing the provider account backs off, once per pause.
    shared: frozenset[str] = frozenset()
    home: HomeBudget | None = None
    told_home: dict[str, float] = field(default_factory=dict)

    def group_paused(self, effect: str, group: str | None) -> bool:
        """Whether the group ``group`` of ``effect`` (limited per group) is paused as far
        as this process knows."""
        until = self.group_until.get((effect, group or ""))
        return until is not None and time.monotonic() < until

    def pause_group(self, effect: str, group: str | None, seconds: float) -> None:
        """Pause one group of ``effect`` here for ``seconds`` (the longer of this and any
        known one). Ended pauses are dropped as new ones come, so the map stays as small
        as the set of groups throttled lately."""
        now = time.monotonic()
        until = now + max(0.0, seconds)
        key = (effect, group or "")
        if until > self.group_until.get(key, 0.0):
            for ended in [k for k, t in self.group_until.items() if t <= now]:
                del self.group_until[ended]
            self.group_until[key] = until

    def paused(self, effect: str, now: float | None = None) -> bool:
        """Whether ``effect`` is paused as far as this process knows."""
        until = max(self.paused_until.get(effect, 0.0), self.local_until.get(effect, 0.0))
        if not until:
            return False
        return (time.monotonic() if now is None else now) < until

    def resumes_at(self, effect: str) -> float:
        """The monotonic time this process expects ``effect``'s pause to end."""
        return max(self.paused_until.get(effect, 0.0), self.local_until.get(effect, 0.0))

    def pause(self, effect: str, seconds: float, reason: str) -> None:
        """Pause ``effect`` here for ``seconds`` (the longer of this and any known one)."""
        until = time.monotonic() + max(0.0, seconds)
        if until > self.paused_until.get(effect, 0.0):
            self.paused_until[effect] = until
            self.reasons[effect] = reason

    def unpause(self, effect: str) -> None:
        self.paused_until.pop(effect, None)
        self.reasons.pop(effect, None)

    def failed_here(self, effect: str) -> None:
        """A worker saw a transient failure: at the breaker's threshold in a row, stop
        starting the effect's jobs here before the recorder has opened it for all."""
        if self.threshold is None:
            return
        failures = self.local_failures[effect] = self.local_failures.get(effect, 0) + 1
        if failures >= self.threshold:
            self.local_failures[effect] = 0
            until = time.monotonic() + BREAKER_PAUSE
            if until > self.local_until.get(effect, 0.0):
                self.local_until[effect] = until

    def throttled_here(self, effect: str, error: Throttled, group: str | None = None) -> None:
        """A worker saw ``error``: stop starting the effect's jobs (of ``group`` only, for
        an effect limited per group) at once, before the recorder has written the pause
        for everyone."""
        seconds = LOCAL_THROTTLE_PAUSE if error.after is None else error.after
        if effect in self.per_group:
            self.pause_group(effect, group, seconds)
            return
        until = time.monotonic() + seconds
        if until > self.local_until.get(effect, 0.0):
            self.local_until[effect] = until
        if effect in self.shared:
            self.tell_home(effect, seconds, until)

    def tell_home(self, effect: str, seconds: float, until: float) -> None:
        """Pause ``effect``'s shared bucket in the home for ``seconds``, unless a pause
        told already lasts as long (throttles come in bursts: one statement a pause)."""
        home = self.home
        if home is None or until <= self.told_home.get(effect, 0.0) + 0.05:
            return
        self.told_home[effect] = until
        threading.Thread(target=home.pause, args=(effect, seconds), daemon=True,
                         name="outbox-limits-home").start()


class LimitedClaims:
    """The claimer's side: which effects the core claim may take, and the budgeted
    claims of the others. Runs on the claimer only."""

    def __init__(self, settings: Settings, view: LimitView, turns: GroupTurns) -> None:
        self.settings = settings
        self.view = view
        self.turns = turns
        view.threshold = settings.breaker_threshold
        view.per_group = frozenset(e for e, lim in settings.limits.items() if lim.per_group)
        self.queries = settings.queries
        self.names = sorted(settings.effects)
        self.all_names = settings.effect_names
        # Effects claimed through their budget this round, and the text[] of the rest.
        self.gated: list[str] = sorted(settings.limits)
        self.free_names = text_array([n for n in self.names if n not in settings.limits])
        self.due_names = self.all_names
        self.wake_in: float | None = None  # seconds until a budget is worth asking again
        self._cache: dict[tuple[str, ...], str] = {}
        home = settings.limits_home
        self.home = home_budget(home) if home is not None else None
        view.shared = frozenset(e for e, lim in settings.limits.items() if lim.shared)
        view.home = self.home

    def refresh(self) -> Step[None]:
        """Read the shared state of this dispatcher's effects (one small query)."""
        rows = yield Statement(self.queries.limit_states, {"effects": self.all_names},
                               named=True)
        gated = set(self.settings.limits)
        operator: list[str] = []
        seen: set[str] = set()
        for state in rows:
            effect = state.effect
            seen.add(effect)
            if state.gated:
                gated.add(effect)
            if state.pause_left is not None and state.pause_left > 0:
                # The database is the authority: an operator's resume shortens a pause.
                self.view.paused_until[effect] = time.monotonic() + state.pause_left
                self.view.reasons[effect] = state.pause_reason
                if state.pause_reason == "operator":
                    operator.append(effect)
            else:
                self.view.unpause(effect)
            if state.troubled:
                self.view.troubled.add(effect)
            else:
                self.view.troubled.discard(effect)
        for effect in list(self.view.paused_until):
            if effect not in seen:  # the row is gone (an operator reset it)
                self.view.unpause(effect)
        now = time.monotonic()
        gated.update(e for e, until in list(self.view.local_until.items()) if until > now)
        self.gated = sorted(gated)
        self.free_names = self._array(tuple(n for n in self.names if n not in gated))
        self.due_names = self._array(tuple(n for n in self.names if n not in operator))

    def _array(self, names: tuple[str, ...]) -> str:
        cached = self._cache.get(names)
        if cached is None:
            cached = self._cache[names] = text_array(list(names))
        return cached

    @property
    def any_free(self) -> bool:
        return self.free_names != "{}"

    def claim(self, room: Callable[[], int]) -> ClaimStep[Rows]:
        """Claim the gated effects' jobs, each within its budget and ``room()``."""
        claimed: Rows = []
        self.wake_in = None
        now = time.monotonic()
        for effect in self.gated:
            declared = self.settings.limits.get(effect)
            shared = declared if declared is not None and declared.shared else None
            if self.view.paused(effect, now):
                left = self.view.resumes_at(effect) - now
                self._wake(left)
                continue
            limit = room()
            if limit <= 0:
                break
            grant: Grant | None = None
            if shared is not None:
                grant = yield from self.take_shared(effect, shared, limit)
                if grant is None:
                    continue
                limit = grant.granted
                # The rate is counted in the home; a concurrency still in this target.
                declared = (None if shared.concurrency is None
                            else Limit(concurrency=shared.concurrency))
            whole = None if declared is None or declared.per_group else declared
            each = declared if declared is not None and declared.per_group else None
            rows = yield Statement(self.queries.limit_claim, {
                "effect": effect, "limit": limit, "lease": self.settings.lease,
                "worker": self.settings.worker_id, "after": self.turns.json(),
                "rate": None if whole is None else whole.rate,
                "burst": None if whole is None else whole.burst,
                "concurrency": None if whole is None else whole.concurrency,
                "group_rate": None if each is None else each.rate,
                "group_burst": None if each is None else each.burst,
                "group_concurrency": None if each is None else each.concurrency,
            }, named=True)
            taken = [row for row in rows if row.id is not None]
            claimed += taken
            if grant is not None and self.home is not None and len(taken) < grant.granted:
                yield HomeCall(partial(self.home.refund, effect, grant.granted - len(taken)))
            if rows:  # limit_claim answers a row always, its walk's end in walked_to
                # Groups at their cap do not hold the turn: the next claim of the effect
                # starts after the last group this one looked at.
                self.turns.resume_after(effect, rows[0].walked_to)
            wait = rows[0].budget_wait if rows else None
            if wait is not None:  # the budget (not the queue) stopped the claim
                self._wake(wait)
        return claimed

    def _wake(self, seconds: float) -> None:
        self.wake_in = seconds if self.wake_in is None else min(self.wake_in, seconds)

    def take_shared(self, effect: str, shared: Limit, want: int) -> ClaimStep[Grant | None]:
        """Tokens of ``effect``'s shared bucket for a claim of up to ``want`` jobs, or None
        when there is nothing to claim here or nothing granted (the next ask is then
        scheduled). Asked only when a job is claimable, so an idle target never holds
        the budget."""
        assert self.home is not None and shared.rate is not None  # checked in settings
        claimable = yield Statement(self.queries.effect_claimable, {"effect": effect},
                                    scalar=True)
        if not claimable or not claimable[0]:
            return None
        grant: Grant = yield HomeCall(
            partial(self.home.grant, effect, want, shared.rate, shared.burst))
        if grant.granted < 1:
            self._wake(grant.wait if grant.wait is not None else HOME_RETRY)
            return None
        if grant.granted < want:  # the budget, not the room, ended it: the next token
            self._wake(1.0 / shared.rate)
        return grant


def is_transient(outcome: object) -> bool:
    """Whether an outcome says the provider may be down: ``Retry``, ``UnknownOutcome``
    or an exception that is not an outcome signal (connection errors, timeouts)."""
    if isinstance(outcome, Retry | UnknownOutcome):
        return True
    return isinstance(outcome, Exception) and not isinstance(outcome, EffectOutcome)


@dataclass
class _Tally:
    throttles: int = 0
    after: float | None = None
    hint: float | None = None
    failures: int = 0
    failed_jobs: list[int] = field(default_factory=list)
    successes: int = 0
    # group ('' for none) -> [throttles, longest Retry-After]: for effects limited per group
    group_throttles: dict[str, list[Any]] = field(default_factory=dict)


def tally(outcomes: Sequence[tuple[Any, object]], troubled: set[str]) -> dict[str, _Tally]:
    """Per effect: throttles (the longest Retry-After, the provider's rate), transient
    failures, and successes of effects in ``troubled``, among ``outcomes`` (held,
    outcome) pairs."""
    tallies: dict[str, _Tally] = {}
    for held, outcome in outcomes:
        if isinstance(outcome, Success):
            if troubled and held.job.effect in troubled:
                tallies.setdefault(held.job.effect, _Tally()).successes += 1
            continue
        effect = held.job.effect
        if isinstance(outcome, Throttled):
            t = tallies.setdefault(effect, _Tally())
            t.throttles += 1
            if outcome.after is not None:
                t.after = outcome.after if t.after is None else max(t.after, outcome.after)
            if outcome.rate is not None:
                t.hint = outcome.rate if t.hint is None else min(t.hint, outcome.rate)
            g = t.group_throttles.setdefault(held.job.group or "", [0, None])
            g[0] += 1
            if outcome.after is not None:
                g[1] = outcome.after if g[1] is None else max(g[1], outcome.after)
        elif is_transient(outcome):
            t = tallies.setdefault(effect, _Tally())
            t.failures += 1
            t.failed_jobs.append(held.job.id)
    return tallies


def report(settings: Settings, view: LimitView,
           outcomes: Sequence[tuple[Any, object]]) -> Step[None]:
    """Write what a batch of outcomes says about the providers: throttles pause an effect
    and cut its rate; transient failures in a row open its breaker; a success closes it.
    Healthy effects cost no statement. A statement refused for another reason than the
    connection is logged and skipped: recording the outcomes matters more."""
    q = settings.queries
    for effect, t in tally(outcomes, view.troubled).items():
        if t.successes and effect in view.troubled:
            yield from _guarded(Statement(q.limit_succeeded, {"effect": effect}))
            view.troubled.discard(effect)
            if view.reasons.get(effect) == "outage":
                view.unpause(effect)
        if t.throttles and effect in view.per_group:
            # The group's provider account pushed back: that group pauses, the others go on.
            for group, (count, after) in t.group_throttles.items():
                rows = yield from _guarded(Statement(q.limit_group_throttled, {
                    "effect": effect, "group": group, "count": count, "after": after},
                    named=True))
                for state in rows:
                    if state.pause_left is not None and state.pause_left > 0:
                        view.pause_group(effect, group, state.pause_left)
                log.info("group %r of effect %s throttled by its provider (%d refusals); "
                         "that group is paused for every dispatcher", group, effect, count)
        elif t.throttles:
            yield from _guarded(Statement(q.limit_ensure, {"effect": effect}, count=True))
            rows = yield from _guarded(Statement(q.limit_throttled, {
                "effect": effect, "count": t.throttles, "after": t.after, "hint": t.hint},
                named=True))
            _learn(view, rows)
            log.info("effect %s throttled by its provider (%d refusals); paused for every "
                     "dispatcher", effect, t.throttles)
        if t.failures and settings.breaker_threshold is not None:
            yield from _guarded(Statement(q.limit_ensure, {"effect": effect}, count=True))
            rows = yield from _guarded(Statement(q.limit_failed, {
                "effect": effect, "count": t.failures, "jobs": t.failed_jobs,
                "threshold": settings.breaker_threshold,
                "pause": BREAKER_PAUSE, "max_pause": BREAKER_MAX_PAUSE}, named=True))
            view.troubled.add(effect)
            opened = _learn(view, rows)
            if opened == "outage":
                log.warning("effect %s: %d transient failures in a row; its breaker is open "
                            "and it is paused for every dispatcher", effect,
                            settings.breaker_threshold)


def _learn(view: LimitView, rows: Rows) -> str | None:
    """Take a pause the database decided into the view; its reason, if paused."""
    for state in rows:  # the effect, pause_left and pause_reason the statement returns
        if state.pause_left is not None and state.pause_left > 0 and state.pause_reason:
            view.pause(state.effect, state.pause_left, state.pause_reason)
            return str(state.pause_reason)
    return None


def _guarded(statement: Statement) -> Step[Rows]:
    from .connection import CONNECTION_ERRORS

    try:
        rows: Rows = yield statement
    except CONNECTION_ERRORS:
        raise
    except psycopg.Error as exc:  # refused: the outcomes matter more than the limit state
        log.error("writing the shared limit state failed (%s); the outcomes are recorded "
                  "without it", exc.sqlstate or type(exc).__name__)
        return []
    return rows
