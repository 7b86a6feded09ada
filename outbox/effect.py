"""What an effect sees: the ``Job`` it performs and the ``Effect`` base class."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, ClassVar

from pydantic import BaseModel

from ._cancelling import CancelSignal
from .limits import Limit

__all__ = ["Effect", "Job"]


@dataclass(frozen=True, slots=True)
class Job:
    """One claimed job, as handed to ``Effect.perform``.

    ``key`` is the stable per-business-effect idempotency key: it is the same on every
    attempt and every re-claim, so an adapter that sends it to the provider gets the
    effect performed once even though ``perform`` may be called more than once
    (delivery to the adapter is at least once).

    An adapter may route by ``group``, e.g. to a tenant's provider account. A job with
    parents (``after=[...]``) is claimed only once every parent is done (or, with
    ``after_failed="run"``, settled for good); ``after_results`` holds what they returned.

    :var id: The job's row id (``outbox retry ID``, the dashboard's ``/jobs/ID``).
    :var effect: The effect's name, e.g. ``"email.send"``.
    :var key: The idempotency key, the same on every attempt: send it to the provider.
    :var payload: The payload as enqueued (decoded JSON).
    :var attempt: Which claim this is, from 1.
    :var claim_version: This claim's fencing token (a later claim has a larger one).
    :var ordering_key: The ordering key it was enqueued with, or None.
    :var max_attempts: Claims allowed before the job goes to ``failed``.
    :var first_attempted_at: When its first attempt started (None before it).
    :var model: The payload validated by the effect's ``payload_model`` (None without one).
    :var group: The group (tenant) it was enqueued with, or None.
    :var priority: The priority it was enqueued with (-1000..1000).
    :var scheduled_for: The slot of the schedule that enqueued it (aware); else None.
    :var after_results: Each parent's key -> its ledger result (``after=[...]``).
    :var cancelled: Set when this claim must stop acting; ``.reason`` says why.
    """

    id: int
    effect: str
    key: str
    payload: dict[str, Any]
    attempt: int
    claim_version: int
    ordering_key: str | None = None
    max_attempts: int = 1
    first_attempted_at: datetime | None = None
    model: Any = field(default=None, compare=False)
    group: str | None = None
    priority: int = 0
    #: The slot (an aware datetime) of the schedule that enqueued the job
    #: (``outbox.Schedule``); None for a job not enqueued by a schedule.
    scheduled_for: datetime | None = None
    #: For a job enqueued with ``after=[...]``: each parent's key -> the result its
    #: ledger row holds (``outbox.FailedParent`` for a parent failed for good, seen only
    #: with ``after_failed="run"``). Empty for a job without parents.
    after_results: Mapping[str, Any] = field(default_factory=dict, compare=False)
    #: Set when this claim must stop acting: an operator cancelled the running job, the
    #: claim was taken over or its lease could not be renewed, the effect's ``timeout``
    #: passed, or ``stop_timeout`` passed after a stop (``job.cancelled.reason`` says
    #: which). A sync ``perform`` checks it between steps (``is_set()``, or ``wait(s)``
    #: in place of a sleep) and raises once it is set; an async ``perform`` is cancelled
    #: (``asyncio.CancelledError``) and may read it too. Made per claim; not compared.
    cancelled: threading.Event = field(default_factory=CancelSignal, compare=False, repr=False)


class Effect:
    """Base class of effects: subclass it, set ``name`` and define ``perform``.

    ``perform(job)`` may be a plain or an ``async def`` method. What it returns (a JSON-
    serialisable mapping, a pydantic model or None) is stored in the effect ledger in the
    same transaction that marks the job ``done``. It steers failures by raising
    ``outbox.Retry``, ``outbox.Permanent`` or ``outbox.UnknownOutcome``; any other
    exception is retried with backoff until ``max_attempts``.

    An effect is an ordinary object: subclasses may define ``__init__`` without calling
    ``super().__init__()``, and one instance serves many jobs at once, so ``perform``
    must be safe to call concurrently (from several threads for a sync ``perform``).

    Set ``payload_model`` to a pydantic model to have the dispatcher validate each
    payload before ``perform`` is called: an invalid payload fails the job at once with
    a message naming the fields, and ``job.model`` holds the validated model.

    Override ``unknown_outcome_window`` (a class attribute or a property) where the
    provider's idempotency window is known: see there.

    Set ``timeout`` (seconds) to bound how long one ``perform`` may act: see there and
    ``Job.cancelled``.

    Set ``limit`` to an ``outbox.Limit`` where the provider publishes one (requests per
    second, requests in flight): every dispatcher running the effect then claims its
    jobs within that budget, shared through the database, unless the dispatcher's own
    ``limits`` names the effect. An effect raises ``outbox.Throttled`` when the provider
    refused for load anyway.
    """

    name: ClassVar[str]
    payload_model: ClassVar[type[BaseModel] | None] = None
    #: The provider's published limit for this effect (None: no declared limit).
    limit: Limit | None = None
    #: Seconds a ``perform`` may run (None: no limit). Once they pass, ``job.cancelled``
    #: is set (an async ``perform`` is cancelled); a perform that then raises may have
    #: acted, so its job is retried with the same key within the idempotency window (or
    #: goes to ``reconcile``). Zero or negative is refused when the dispatcher is built.
    timeout: float | None = None

    @property
    def unknown_outcome_window(self) -> float | timedelta | None:
        """How long the provider remembers an idempotency key (seconds or a timedelta),
        counted from a job's first attempt; None (this default): the dispatcher's.

        For this effect's jobs the dispatcher uses it instead of its own
        ``unknown_outcome_window``, longer or shorter: an ``UnknownOutcome``, or a lease
        that expired mid-attempt, is retried with the same key inside it and goes to
        ``reconcile`` past it. Checked when the dispatcher is built (a bad value raises
        ``ConfigurationError``) and read again at each decision, so a property may learn
        it late (once connected to the provider, say). Override it with a class
        attribute (``unknown_outcome_window = 3600.0``) or a property.
        """
        return None

    def perform(self, job: Job) -> Mapping[str, Any] | BaseModel | Awaitable[Any] | None:
        """Perform the effect for ``job``; see the class docstring for the contract."""
        raise NotImplementedError(f"{type(self).__name__} must define perform()")

    # -- flows (see ``outbox.flows``) --------------------------------------------------

    def on_done(self, tx: Any, job: Job, result: Any) -> Any:
        """Called inside the fenced ``done`` transaction of ``job`` (no-op by default).

        ``tx`` is an ``outbox.flows.HookTransaction`` (``tx.execute``, ``tx.enqueue``,
        ``tx.connection``); ``result`` is the ledger's JSON value of what ``perform``
        returned. The hook's writes, its follow-up jobs, the ledger row and the fenced
        ``running -> done`` commit together or not at all; a claim that lost its fence
        never calls it. If it raises, its writes roll back, the job is retried later
        without calling the provider again (the result obtained is kept with the job and
        reused), and after ``max_attempts`` the job is ``failed`` with the hook's error
        while the result goes to the ledger. May be ``async def`` on ``AsyncDispatcher``
        (then ``tx`` is an ``AsyncHookTransaction``).
        """
        return None

    def on_failed(self, tx: Any, job: Job, error: BaseException) -> Any:
        """Called inside the fenced ``failed`` transaction of ``job`` (no-op by default).

        Runs when the effect itself ends ``failed`` from an attempt: ``outbox.Permanent``
        (a card declined, an invalid payload) or the attempts exhausted; ``error`` is the
        exception of that last attempt. It does not run when the provider did act and only
        ``on_done`` kept failing (the result is in the ledger then). A job whose lease
        expired (its worker died or stalled) is an unknown outcome, settled by the
        rescuer as one raised by ``perform``: retried after the backoff, or ``reconcile``
        once its attempts are used up (no ``failed``, so no hook); a claim an operator
        cancelled ends ``failed`` there and this hook runs, as after a perform. Same
        transaction
        rules as ``on_done``; if it raises, its writes roll back and the job is retried
        (the provider is asked again with the same key, which replays its answer), and
        after ``max_attempts`` it is ``failed`` without the hook's writes.
        """
        return None

    def reconcile(self, job: Job) -> Any:
        """Ask the provider what became of ``job`` whose outcome is unknown (None by default).

        Return ``outbox.Performed(result)`` when the provider acted (ledger, ``done`` and
        ``on_done``, fenced), ``outbox.NotPerformed()`` when it has no trace (the job goes
        back to ``pending`` under the same key), or None when the answer is still unknown
        (asked again later, with backoff). Raise when the provider cannot be reached: such
        passes do not count toward giving up. Called by a dispatcher's maintenance, outside
        any transaction, for jobs in ``reconcile``; may be ``async def``. An effect that
        defines it also has an ``UnknownOutcome`` whose next retry would come after its
        window closes sent to ``reconcile`` at once, to be asked while the key is known.
        """
        return None


def is_async_effect(effect: Effect) -> bool:
    """True when the effect's ``perform`` is a coroutine function."""
    return inspect.iscoroutinefunction(effect.perform)
