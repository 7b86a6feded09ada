"""Turning a job's payload into the adapter's pydantic model, or a Permanent outcome."""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ValidationError

from outbox import Job, Permanent, Retry

__all__ = ["describe_validation_error", "stop_if_told", "validated_payload"]

ModelT = TypeVar("ModelT", bound=BaseModel)


def validated_payload(model: type[ModelT], job: Job) -> ModelT:
    """The job's payload as ``model``: ``job.model`` when the dispatcher validated it.

    Otherwise the payload is validated here, so ``perform`` works on hand-built jobs too.
    An invalid payload raises ``Permanent`` naming the fields, never their values (a
    payload may hold personal data).
    """
    if isinstance(job.model, model):
        return job.model
    try:
        return model.model_validate(job.payload)
    except ValidationError as exc:
        reason = f"invalid {job.effect} payload for job {job.key}: "
        raise Permanent(reason + describe_validation_error(exc)) from exc


def describe_validation_error(exc: ValidationError) -> str:
    """One line per problem, ``field: message``, without the offending input values."""
    problems = []
    for error in exc.errors(include_input=False, include_url=False, include_context=False):
        where = ".".join(str(part) for part in error["loc"]) or "payload"
        problems.append(f"{where}: {error['msg']}")
    return "; ".join(problems)


def stop_if_told(job: Job, what: str) -> None:
    """Raise ``outbox.Retry`` when ``job.cancelled`` is set, before a step that would act.

    An adapter calls it right before each request that reaches the provider: a perform
    told to stop (an operator's cancel, a claim taken over, a lease not renewed, the
    effect's timeout, a stop) then sends nothing more. ``Retry`` says so truthfully (this
    step did not act); the dispatcher settles it by the reason it was told (an operator's
    cancel ends failed). ``what`` names the job by key, never by payload.
    """
    if job.cancelled.is_set():
        reason = getattr(job.cancelled, "reason", None) or "set"
        raise Retry(f"{what}: told to stop ({reason}) before sending; nothing sent")
