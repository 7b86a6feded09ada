"""Pure core of enqueue and receive: validation, canonical JSON, fingerprints, and the
conversation with the database as steps.

Every transaction kind (psycopg sync and async, SQLAlchemy, Django) runs the same steps
(``_steps``): a step yields a ``Statement`` (a block of ``enqueue.sql`` bound to the
schema, and its parameters), the kind executes it its own way and sends the rows back,
and the step returns the result or raises the outbox error. So validation, the SQL, the
interpretation of rows and the error mapping exist once, and every kind accepts and
refuses exactly the same input. No I/O here.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from functools import cache
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from . import _after, registry, tracing
from ._lifecycle import shown_number
from ._steps import Statement, Step
from .errors import (
    IdempotencyKeyConflict,
    InvalidArgument,
    InvalidKey,
    InvalidPayload,
    UnknownEffect,
)

if TYPE_CHECKING:
    from ._sql import Queries

_json_string = json.encoder.encode_basestring_ascii  # str -> JSON string literal (C)

MAX_KEY_LENGTH = 255
MAX_PAYLOAD_BYTES = 1_000_000
DEFAULT_MAX_ATTEMPTS = 25
# A JSON \u0000 escape, i.e. one not itself escaped: "\\u0000" is a backslash and "u0000".
_JSON_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")

Payload = Mapping[str, Any] | BaseModel
Row = Any  # a named tuple of a statement asked with named=True


@dataclass(frozen=True, slots=True)
class EnqueueResult:
    """What ``enqueue`` did: ``created`` is False when the key was already known.

    ``job_id`` names the new or the existing job; it is None when only the effect ledger
    remembers the key (the job finished and its row was removed by retention).

    :var job_id: The id of the job this key names (new or existing); None when only the
        ledger still remembers the key.
    :var created: True when this call wrote the job; False when the key was already
        known (with the same effect and payload), so nothing was written.
    """

    job_id: int | None
    created: bool


@dataclass(frozen=True, slots=True)
class NewJob:
    """One job for ``enqueue_many``; the fields mean what ``enqueue``'s arguments mean.

    :param effect: The effect's name (``Effect.name``), e.g. ``"email.send"``.
    :param key: The idempotency key: 1..255 printable ASCII characters, the same for
        every retry of the business operation (``"email-order-102"``).
    :param payload: The job's input: a JSON-serialisable mapping or a pydantic model
        (at most 1,000,000 bytes as JSON).
    :param run_at: When the first attempt may start: an aware datetime, or a delay
        (a ``timedelta``) from now; None: at once.
    :param ordering_key: Jobs sharing it run one at a time, in enqueue order.
    :param max_attempts: Claims before the job goes to ``failed`` (None: the default, 25).
    :param group: A tenant, customer or account (at most 255 characters): an effect's
        due jobs are claimed across groups in turn.
    :param priority: -1000..1000, higher first within the group; each level counts as
        10 seconds of waiting.
    :param after: Keys of parent jobs: this job is due once every one of them is done
        (``job.after_results`` holds their results).
    :param after_failed: What a parent failed for good does to this job: ``"fail"``
        (fail it too, never performed) or ``"run"`` (perform it, the parent's entry in
        ``after_results`` an ``outbox.FailedParent``).
    """

    effect: str
    key: str
    payload: Payload
    run_at: datetime | timedelta | None = None
    ordering_key: str | None = None
    max_attempts: int | None = None
    group: str | None = None
    priority: int = 0
    after: Sequence[str] | None = None
    after_failed: str = "fail"


@dataclass(slots=True)
class PreparedJob:
    """A validated job, ready to bind: payload as canonical JSON text plus fingerprint.

    Never changed once made (``prepare`` makes it from validated input). Not a frozen
    dataclass only because a frozen one sets each field through ``object.__setattr__``:
    three times the cost of the plain ``__init__``, paid for every job of every enqueue
    (about 3 µs a job, a tenth of an ``enqueue_many``'s work per job, measured)."""

    effect: str
    key: str
    payload_json: str
    fingerprint: str
    run_at: datetime | None
    ordering_key: str | None
    max_attempts: int
    group: str | None = None
    priority: int = 0
    after: tuple[str, ...] = ()  # parent keys (outbox._after), unique, in order given
    after_failed: str = "fail"


MAX_GROUP_LENGTH = 255
MAX_EFFECT_LENGTH = 255
MAX_PRIORITY = 1000  # claim_rank (migration 0010): 10 s of ageing per level
MAX_ATTEMPTS = 2**31 - 1  # the column is an integer


def effect_name_problem(name: str) -> str | None:
    """What makes the non-empty string ``name`` unfit as an effect's name, or None: at
    most 255 characters, each printable (no NUL, control character or lone surrogate,
    which PostgreSQL's text cannot hold or a log line would garble), no whitespace at
    either end (a job named so would wait for an effect nobody registers)."""
    if len(name) > MAX_EFFECT_LENGTH:
        return (f"effect name is {len(name)} characters long; at most {MAX_EFFECT_LENGTH} "
                "are allowed")
    if not name.isprintable():
        position, char = next((i, c) for i, c in enumerate(name) if not c.isprintable())
        return (f"effect name {name[:40]!r} has a character that is not printable "
                f"({char!r}) at position {position}")
    if name.strip() != name:
        return f"effect name {name[:40]!r} has whitespace at its start or end"
    return None


def validate_group(group: object) -> str | None:
    """Return ``group`` if it is None or 1..255 characters PostgreSQL text can hold,
    else raise InvalidArgument saying what is wrong."""
    if group is None:
        return None
    if not isinstance(group, str):
        raise InvalidArgument(
            f"group must be a string (a tenant, customer or account) or None, "
            f"got {type(group).__name__}")
    if not group:
        raise InvalidArgument("group must not be empty (None means no group)")
    if len(group) > MAX_GROUP_LENGTH:
        raise InvalidArgument(
            f"group is {len(group)} characters long; at most {MAX_GROUP_LENGTH} are allowed")
    if "\x00" in group:  # jsonb_problem looks for the escaped form JSON text has
        raise InvalidArgument(f"group {group[:40]!r} holds a NUL character, which "
                              "PostgreSQL's text cannot store")
    problem = jsonb_problem(group)
    if problem:
        raise InvalidArgument(f"group {group[:40]!r} holds {problem}".replace("jsonb", "text"))
    return group


def validate_priority(priority: object) -> int:
    """Return ``priority`` if it is an int in -1000..1000, else raise InvalidArgument."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidArgument(
            f"priority must be an integer (higher first, default 0), got {priority!r}"[:200])
    if not -MAX_PRIORITY <= priority <= MAX_PRIORITY:
        raise InvalidArgument(
            f"priority is {priority}; it must be between {-MAX_PRIORITY} and {MAX_PRIORITY}")
    return priority


def validate_key(key: object, *, what: str = "key") -> str:
    """Return ``key`` if it is 1..255 printable ASCII characters, else raise InvalidKey."""
    if not isinstance(key, str):
        raise InvalidKey(f"{what} must be a string, got {type(key).__name__}")
    if not key:
        raise InvalidKey(f"{what} must not be empty")
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidKey(
            f"{what} is {len(key)} characters long; at most {MAX_KEY_LENGTH} are allowed "
            "(providers cap idempotency keys at 255)"
        )
    if not (key.isascii() and key.isprintable()):
        position, char = next((i, c) for i, c in enumerate(key) if not " " <= c <= "~")
        raise InvalidKey(
            f"{what} {key[:40]!r} has a character that is not printable ASCII "
            f"({char!r}) at position {position}"
        )
    return key


def _not_serialisable(value: Any) -> Any:
    # json calls this only for objects it has no encoding for; NaN and infinities never
    # get here (allow_nan=False raises ValueError for them, handled in canonical_json).
    # json encodes dicts only; any other mapping (a MappingProxyType, a Mapping of one's
    # own) is a JSON object all the same, as is a pydantic model inside the payload:
    # encoded as the dict of the same items, so they fingerprint as that dict does.
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", by_alias=True)
    raise InvalidPayload(f"payload holds a {type(value).__name__}, which is not JSON-serialisable")


def jsonb_problem(text: str) -> str | None:
    """Why PostgreSQL's jsonb would refuse the JSON ``text``, or None if it can store it."""
    if "\\u0000" in text and _JSON_NUL.search(text):
        return "a NUL character (\\u0000), which jsonb cannot store"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "a lone surrogate (half of a UTF-16 pair), which is not valid UTF-8"
    return None


def _non_finite(value: Any, path: str = "payload") -> str | None:
    """Where ``value`` holds NaN or an infinity (e.g. ``payload['amount'] = nan``), or None."""
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{path} = {value!r}"
    if isinstance(value, Mapping):
        items: Any = ((f"{path}[{k!r}]", v) for k, v in value.items())
    elif isinstance(value, list | tuple):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    return next((found for p, v in items if (found := _non_finite(v, p))), None)


# A float json.dumps writes otherwise than jsonb prints its number: an exponent (repr
# writes 1e+16, 1.5e-07) or a negative zero. Substring tests first (most payloads hold
# none of them), then the pattern, which may also match inside a string; the tokens then
# tell numbers from strings.
_NOT_JSONB_NUMBER = re.compile(r"\de[-+]|-0\.0")
_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?')


def _jsonb_number(match: re.Match[str]) -> str:
    token = match.group()
    if token[0] == '"' or not ("e" in token or "E" in token or token.startswith("-0.0")):
        return token
    number = Decimal(token)
    return format(abs(number) if number == 0 else number, "f")


def as_jsonb_numbers(text: str) -> str:
    """JSON ``text`` with each number as PostgreSQL's jsonb prints it (``1e+16`` as
    ``10000000000000000``, ``1.5e-07`` as ``0.00000015``, ``-0.0`` as ``0.0``), so the
    canonical JSON made here is the one ``<schema>.canonical_json`` makes of the stored
    payload (migration 0017): one fingerprint for Python and SQL callers."""
    if ("e+" not in text and "e-" not in text and "-0.0" not in text) or (
            not _NOT_JSONB_NUMBER.search(text)):
        return text
    return _JSON_TOKEN.sub(_jsonb_number, text)


# One encoder for every payload (json.dumps with options builds one a call); its
# encode() runs the C encoder.
_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                            allow_nan=False, default=_not_serialisable)


def canonical_json(payload: object) -> str:
    """The payload as canonical JSON (sorted keys, no spaces, numbers as jsonb prints
    them); raise InvalidPayload."""
    if isinstance(payload, BaseModel):
        payload = payload.model_dump(mode="json", by_alias=True)
    if not isinstance(payload, Mapping):
        raise InvalidPayload(
            f"payload must be a mapping or a pydantic model, got {type(payload).__name__}"
        )
    try:
        text = _ENCODER.encode(payload)
    except InvalidPayload:
        raise
    except ValueError as exc:  # NaN / Infinity with allow_nan=False, circular references
        try:
            where = _non_finite(payload) if "Out of range float" in str(exc) else None
        except RecursionError:
            where = None
        if where:
            raise InvalidPayload(
                f"payload is not valid JSON: {where} (NaN and infinities have no JSON form)"
            ) from None
        raise InvalidPayload(f"payload is not valid JSON: {exc}") from None
    except TypeError as exc:  # e.g. non-string dict keys of unsortable types
        raise InvalidPayload(f"payload is not JSON-serialisable: {exc}") from None
    except RecursionError:
        raise InvalidPayload("payload is nested too deeply to serialise") from None
    text = as_jsonb_numbers(text)
    problem = jsonb_problem(text)
    if problem:
        raise InvalidPayload(f"payload holds {problem}")
    # At most 4 bytes a character: a short text needs no encoding to be measured.
    if len(text) * 4 > MAX_PAYLOAD_BYTES and len(text.encode()) > MAX_PAYLOAD_BYTES:
        raise InvalidPayload(
            f"payload is {len(text.encode())} bytes as JSON; at most {MAX_PAYLOAD_BYTES} "
            "are allowed (store large data in your own tables and pass its id)"
        )
    return text


def fingerprint(effect: str, payload_json: str) -> str:
    """Identify (effect, payload) so a reused key with another request is detected."""
    return hashlib.sha256(f"{effect}\n{payload_json}".encode()).hexdigest()


def _resolve_run_at(run_at: datetime | timedelta | None) -> datetime | None:
    if run_at is None:
        return None
    if isinstance(run_at, timedelta):
        try:
            return datetime.now(UTC) + run_at
        except OverflowError:
            raise InvalidArgument(
                f"run_at is a delay of {run_at.days} days, past the calendar's end "
                "(year 9999)") from None
    if isinstance(run_at, datetime):
        if run_at.tzinfo is None or run_at.utcoffset() is None:
            raise InvalidArgument(
                "run_at must be timezone-aware (a naive datetime is ambiguous): "
                "e.g. datetime.now(UTC) + timedelta(hours=1), or just timedelta(hours=1)")
        try:  # in UTC it must still be a date Python can read back (the dashboard does)
            run_at.astimezone(UTC)
        except OverflowError:
            raise InvalidArgument(
                f"run_at {run_at.isoformat()} is outside the calendar (the years 1 to 9999) "
                "in UTC") from None
        return run_at
    raise InvalidArgument(
        f"run_at must be a datetime or timedelta, got {type(run_at).__name__} "
        f"{str(run_at)[:60]!r}: an aware datetime, or a delay such as timedelta(minutes=5)")


def _effect_problem(effect: object) -> str:
    """What is wrong with an ``effect`` argument that is not a non-empty string."""
    name = getattr(effect, "name", None)
    if isinstance(name, str) and name and hasattr(effect, "perform"):
        given = f"the class {effect.__name__}" if isinstance(effect, type) else (
            f"a {type(effect).__name__} object")
        return (f"effect must be the effect's name, a string such as {name!r}, "
                f"got {given}: enqueue({name!r}, ...)")
    return f"effect must be a non-empty string (an effect's name, e.g. 'email.send'), " \
           f"got {effect!r}"[:200]


def prepare(
    effect: str,
    key: str,
    payload: object,
    run_at: datetime | timedelta | None = None,
    ordering_key: str | None = None,
    max_attempts: int | None = None,
    group: str | None = None,
    priority: int = 0,
    after: Iterable[str] | None = None,
    after_failed: str = "fail",
) -> PreparedJob:
    """Validate one enqueue request; raise an EnqueueError naming what is wrong."""
    if not isinstance(effect, str) or not effect.strip():
        raise InvalidArgument(_effect_problem(effect))
    problem = effect_name_problem(effect)
    if problem:
        raise InvalidArgument(problem)
    registry.check(effect, payload)
    validate_key(key)
    if ordering_key is not None:
        validate_key(ordering_key, what="ordering_key")
    if max_attempts is None:
        max_attempts = DEFAULT_MAX_ATTEMPTS
    elif isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
        raise InvalidArgument(
            f"max_attempts must be a positive integer, got {max_attempts!r}"[:200])
    elif max_attempts > MAX_ATTEMPTS:  # else the database refuses it, aborting the transaction
        raise InvalidArgument(f"max_attempts must be at most {MAX_ATTEMPTS}, "
                              f"got {shown_number(max_attempts)}")
    if group is not None:
        validate_group(group)
    if type(priority) is not int or priority != 0:  # 0.0 and False are refused there
        validate_priority(priority)
    if after is None and after_failed == "fail":  # the common case, without the call
        parents: tuple[str, ...] = ()
    else:
        parents, after_failed = _after.validate_after(after, key, after_failed)
    if parents and run_at is not None:
        raise InvalidArgument(
            "run_at and after cannot be combined: a job with after=[...] is due when its "
            "parents are done (enqueue it from the last parent's on_done to delay it)")
    payload_json = canonical_json(payload)
    return PreparedJob(
        effect=effect,
        key=key,
        payload_json=payload_json,
        fingerprint=fingerprint(effect, payload_json),
        run_at=_resolve_run_at(run_at),
        ordering_key=ordering_key,
        max_attempts=max_attempts,
        group=group,
        priority=priority,
        after=parents,
        after_failed=after_failed,
    )


def single_params(job: PreparedJob, channel: str,
                  trace_context: str | None = None) -> dict[str, Any]:
    """Parameters of the ``enqueue`` query."""
    return {
        "trace_context": trace_context,
        "effect": job.effect,
        "key": job.key,
        "payload": job.payload_json,
        "fingerprint": job.fingerprint,
        "run_at": job.run_at,
        "ordering_key": job.ordering_key,
        "max_attempts": job.max_attempts,
        "group_key": job.group,
        "priority": job.priority,
        "channel": channel,
    }


def many_params(jobs: Sequence[PreparedJob], channel: str,
                trace_context: str | None = None) -> dict[str, Any]:
    """Parameters of the ``enqueue_many`` query: the jobs as one JSON array.

    Built by hand around each payload's canonical JSON text rather than re-encoded: the
    bulk path's cost is per job, and this keeps it to a few string joins. A field left
    at its default (no run_at, ordering_key or group; priority 0) is left out: the
    statement reads a missing field as NULL (priority: 0), and the server parses about a
    fifth less text (8 % of the statement's CPU for 1,000 jobs, measured).
    """
    rows = []
    for job in jobs:
        optional = ""
        if job.run_at is not None:
            optional += f',"run_at":{_json_string(job.run_at.isoformat())}'
        if job.ordering_key is not None:
            optional += f',"ordering_key":{_json_string(job.ordering_key)}'
        if job.group is not None:
            optional += f',"group_key":{_json_string(job.group)}'
        if job.priority:
            optional += f',"priority":{job.priority}'
        rows.append(
            f'{{"effect":{_json_string(job.effect)},"key":{_json_string(job.key)},'
            f'"payload":{job.payload_json},"fingerprint":"{job.fingerprint}",'
            f'"max_attempts":{job.max_attempts}{optional}}}'
        )
    return {"jobs": "[" + ",".join(rows) + "]", "channel": channel,
            "trace_context": trace_context}


def existing_result(
    job: PreparedJob, job_id: int | None, effect: str | None, fingerprint_: str | None
) -> EnqueueResult:
    """The result for a key that already existed, or IdempotencyKeyConflict."""
    if effect != job.effect:
        raise IdempotencyKeyConflict(job.key, f"for effect {effect!r}, not {job.effect!r}")
    if fingerprint_ != job.fingerprint:
        raise IdempotencyKeyConflict(job.key, f"for {effect!r} with a different payload")
    return EnqueueResult(job_id=job_id, created=False)


def dedupe_batch(jobs: Sequence[PreparedJob],
                 seen: dict[str, PreparedJob] | None = None) -> list[PreparedJob]:
    """Unique jobs of a batch in first-seen order; a key repeated with another request
    raises IdempotencyKeyConflict before anything is sent. ``seen``: the unique jobs of
    the batch's earlier parts (filled in), whose keys count as seen."""
    seen = {} if seen is None else seen
    new = []
    for job in jobs:
        first = seen.setdefault(job.key, job)
        if first is not job:
            existing_result(job, None, first.effect, first.fingerprint)
        else:
            new.append(job)
    return new


@cache
def notify_channel(schema: str) -> str:
    """The LISTEN/NOTIFY channel for a schema (a hint that jobs were enqueued)."""
    digest = hashlib.sha1(schema.encode(), usedforsecurity=False).hexdigest()[:16]
    return f"outbox_{digest}"


def prepare_many(jobs: Iterable[NewJob]) -> list[PreparedJob]:
    """Validate every job of a batch; the error names the job's position and key."""
    prepared = prepare_part(jobs)
    _parents_come_first(prepared)
    return prepared


def prepare_part(jobs: Iterable[NewJob], first: int = 0) -> list[PreparedJob]:
    """Validate a part of a batch whose first job is the batch's ``first``: the error
    names the job's position in the batch and its key. (``_parents_come_first`` is the
    whole batch's check.)"""
    prepared = []
    for index, job in enumerate(jobs, first):
        if not isinstance(job, NewJob):
            raise InvalidArgument(
                f"job #{index} must be an outbox.NewJob(effect, key, payload, ...), got "
                f"{type(job).__name__}")
        try:
            prepared.append(
                prepare(job.effect, job.key, job.payload, job.run_at, job.ordering_key,
                        job.max_attempts, job.group, job.priority, job.after,
                        job.after_failed)
            )
        except (InvalidKey, InvalidPayload, UnknownEffect, InvalidArgument) as exc:
            raise type(exc)(f"job #{index} ({job.key!r}): {exc}") from None
    return prepared


def _parents_come_first(jobs: Sequence[PreparedJob]) -> None:
    """A job of a batch may name an earlier job of the batch as a parent, never a later
    one (so no cycle can be built within a batch either): InvalidArgument otherwise."""
    first: dict[str, int] = {}
    for index, job in enumerate(jobs):
        first.setdefault(job.key, index)
    for index, job in enumerate(jobs):
        for parent in job.after:
            at = first.get(parent)
            if at is not None and at > index:
                raise InvalidArgument(
                    f"job #{index} ({job.key!r}): after names {parent!r}, job #{at} of the "
                    "same batch: a parent must come before the jobs that wait on it")


def many_results(
    jobs: Sequence[PreparedJob], unique: Sequence[PreparedJob], created: dict[str, int],
    found: dict[str, Row],
) -> list[EnqueueResult]:
    """Each job's result, in the batch's order: ``created`` (key: id) for the keys the
    batch inserted, ``found`` (``lookup_keys``'s rows) for the others, which are repeats
    or conflicts (``existing_result``)."""
    by_key: dict[str, EnqueueResult] = {}
    for job in unique:
        if job.key in created:
            by_key[job.key] = EnqueueResult(job_id=created[job.key], created=True)
        else:
            known = found[job.key]
            by_key[job.key] = existing_result(job, known.id, known.effect, known.fingerprint)
    results = []
    reported: set[str] = set()
    for job in jobs:
        result = by_key[job.key]
        # A key repeated within one batch is created once; its repeats report created=False.
        if job.key in reported and result.created:
            result = EnqueueResult(job_id=result.job_id, created=False)
        reported.add(job.key)
        results.append(result)
    return results


class BatchInParts:
    """The client's side of a batch sent in parts (``Transaction.enqueue_many`` and its
    asyncio mirror, which do the sending): each part prepared and its repeats dropped
    only when the part before has been sent, so that the server inserts one part while
    the client prepares the next; what refused a part (a job invalid, a key repeated
    with another request); each job's result from the parts' rows. No I/O of its own."""

    def __init__(self, batch: Sequence[NewJob], part: int, schema: str) -> None:
        self.batch = batch
        self.part = part
        self.channel = notify_channel(schema)
        self.seen: dict[str, PreparedJob] = {}  # the unique jobs, in first-seen order
        self.prepared: list[PreparedJob] = []
        self.refused: Exception | None = None  # raised once the sent parts are taken back
        self.created: dict[str, int] = {}

    def parts(self) -> Iterator[dict[str, Any]]:
        """The ``enqueue_many`` parameters of each part with new keys, prepared as they
        are asked for; a part that refuses ends them (``refused``)."""
        for first in range(0, len(self.batch), self.part):
            try:
                part = prepare_part(self.batch[first:first + self.part], first)
                new = dedupe_batch(part, self.seen)
            except Exception as exc:  # the parts sent are taken back, then it is raised
                self.refused = exc
                return
            self.prepared.extend(part)
            if new:
                yield many_params(new, self.channel)

    def answered(self, rows: Iterable[Row]) -> list[int]:
        """Take the parts' rows (``enqueue_many``'s): the ids of the jobs they created."""
        self.created = {row.key: row.id for row in rows if row.key is not None}
        return list(self.created.values())

    def missing(self) -> list[str]:
        """The batch's keys no part created: repeats or conflicts, for ``lookup_keys``."""
        return [key for key in self.seen if key not in self.created]

    def results(self, found: Iterable[Row]) -> list[EnqueueResult]:
        """Each job's result in the batch's order, ``found`` the ``lookup_keys`` rows."""
        return many_results(self.prepared, list(self.seen.values()), self.created,
                            {known.key: known for known in found})


def enqueue_steps(job: PreparedJob, queries: Queries) -> Step[EnqueueResult]:
    """Insert one prepared job unless its key is known; the result or the conflict."""
    if not (job.after or tracing.enabled()):
        # The common case, with no span to open (its context manager cost a tenth of
        # this path's Python) and no parents: the statement, and a lookup for a known key.
        created = yield Statement(queries.enqueue, single_params(
            job, notify_channel(queries.schema)), named=True)
        if created:  # the new job's id (and whether the statement notified)
            return EnqueueResult(job_id=created[0].id, created=True)
        [known] = yield Statement(queries.lookup_keys, {"keys": [job.key]}, named=True)
        return existing_result(job, known.id, known.effect, known.fingerprint)
    with tracing.producer_span(job.effect) as send:
        if job.after:  # parents that exist, checked before anything is written
            yield from _after.check_steps([job], queries.schema)
        params = single_params(job, notify_channel(queries.schema), send.context)
        created = yield Statement(queries.enqueue, params, named=True)
        if created:  # the new job's id (and whether the statement notified)
            result = EnqueueResult(job_id=created[0].id, created=True)
        else:  # a known key (or one inserted concurrently): whose is it
            [known] = yield Statement(queries.lookup_keys, {"keys": [job.key]}, named=True)
            result = existing_result(job, known.id, known.effect, known.fingerprint)
        if job.after and result.created and result.job_id is not None:
            yield from _after.link_steps([(result.job_id, job)], queries.schema)
        send.enqueued(result.job_id, result.created)
        return result


def _batch_name(jobs: Sequence[PreparedJob]) -> str:
    """The effect a batch's span is named after (``batch`` when they differ)."""
    if not tracing.enabled():
        return ""
    effects = {job.effect for job in jobs}
    return effects.pop() if len(effects) == 1 else "batch"


def enqueue_many_steps(jobs: Sequence[PreparedJob],
                       queries: Queries) -> Step[list[EnqueueResult]]:
    """Insert a prepared batch in one statement (two if some keys are already known)."""
    unique = dedupe_batch(jobs)
    if not unique:
        return []
    with tracing.producer_span(_batch_name(unique), len(unique)) as send:
        waiting = [job for job in unique if job.after]
        if waiting:  # parents that exist (or come earlier in the batch), checked first
            yield from _after.check_steps(unique, queries.schema)
        params = many_params(unique, notify_channel(queries.schema), send.context)
        inserted = yield Statement(queries.enqueue_many, params, named=True)
        created = {new.key: new.id for new in inserted if new.key is not None}
        if waiting:
            yield from _after.link_steps(
                [(created[job.key], job) for job in waiting if job.key in created],
                queries.schema)
        found: dict[str, Row] = {}
        missing = [job.key for job in unique if job.key not in created]
        if missing:
            looked_up = yield Statement(queries.lookup_keys, {"keys": missing}, named=True)
            found = {known.key: known for known in looked_up}
        send.enqueued_many(len(created), len(unique))
        return many_results(jobs, unique, created, found)


def receive_steps(consumer: str, message_id: str, queries: Queries) -> Step[bool]:
    """Record ``message_id`` in ``consumer``'s inbox; True unless it was already there."""
    validate_key(consumer, what="consumer")
    validate_key(message_id, what="message_id")
    rows = yield Statement(queries.receive, {"consumer": consumer, "message_id": message_id})
    return bool(rows)


def receive_many_steps(consumer: str, message_ids: Sequence[str],
                       queries: Queries) -> Step[list[bool]]:
    """``receive_steps`` for many messages in one statement: for each id in order, True
    if it is recorded now (a repeated id within ``message_ids``: True only the first time)."""
    validate_key(consumer, what="consumer")
    for message_id in message_ids:
        validate_key(message_id, what="message_id")
    if not message_ids:
        return []
    recorded = yield Statement(queries.receive_many,
                               {"consumer": consumer, "message_ids": list(message_ids)},
                               scalar=True)  # the message ids recorded now
    new = set(recorded)
    first = []
    for message_id in message_ids:
        first.append(message_id in new)
        new.discard(message_id)
    return first


def resolve_steps(key: str, result: Mapping[str, Any] | None, source: str,
                  queries: Queries) -> Step[int | None]:
    """The provider says the job ``key`` was performed: the id of the job resolved, or
    None (see ``Operations.resolve_performed``)."""
    validate_key(key)
    text = "null" if result is None else canonical_json(result)
    resolved = yield Statement(queries.resolve_by_event, {
        "key": key, "result": text,
        "note": f"resolved as performed by the provider ({source[:200]})",
        "source": source[:200], "channel": notify_channel(queries.schema)},
        scalar=True)  # the id of the job resolved
    return int(resolved[0]) if resolved else None
