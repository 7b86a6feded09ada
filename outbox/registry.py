"""The effects an application may enqueue, checked at ``enqueue``: ``register_effects``.

Optional. Without it, ``enqueue`` takes any effect name, and a typo (``email.sned``)
is found only later: no dispatcher claims the job, and the dispatchers and ``outbox
status`` report it as waiting for an effect nobody serves. With it::

    outbox.register_effects(SendEmail, ChargeCard, "audit.log")

``enqueue`` in this process refuses, inside the business transaction and before
anything is sent, an effect name that is not registered (``outbox.UnknownEffect``,
naming the closest registered one) and a payload that its effect's ``payload_model``
rejects (``outbox.InvalidPayload`` naming the fields, never their values). Register
effect classes or instances (their ``name`` and ``payload_model``) or plain names.

Without it, a process that also builds a dispatcher (a test, a script, a FastAPI app
running an ``AsyncDispatcher``) still gets a hint: ``enqueue`` of a name that none of
this process's dispatchers runs, but that is a slip of one of theirs (``emial.send``),
logs one warning naming the closest (``did you mean 'email.send'?``), once per name.
The job is enqueued all the same (another process may run that effect). It costs a set
lookup per enqueue and no query.
"""

from __future__ import annotations

import difflib
import logging
import threading
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

from pydantic import BaseModel, ValidationError

from .errors import InvalidPayload, UnknownEffect

__all__ = ["clear_registered_effects", "register_effects", "registered_effects"]

log = logging.getLogger("outbox")

_lock = threading.Lock()
# Replaced whole on each change, so enqueue reads it without the lock.
_registered: Mapping[str, type[BaseModel] | None] = MappingProxyType({})
# The effects the dispatchers built in this process run (for enqueue's typo hint), and
# the names already hinted about (a hint is logged once per name).
_served: frozenset[str] = frozenset()
_hinted: set[str] = set()


HINT_CUTOFF = 0.85
"""How alike (difflib's ratio) a name enqueued must be to a served one for enqueue's
hint: a slip of a letter or two (``email.sned``, ``emial.send``: 0.9), not a sibling
effect a hook enqueues for another dispatcher (``billing.charge`` beside
``billing.nightly``: 0.62)."""


def closest(name: str, known: Iterable[str], cutoff: float = 0.6) -> str | None:
    """The known effect name closest to ``name`` (difflib's ratio of at least
    ``cutoff``), or None: what a "did you mean" names."""
    found = difflib.get_close_matches(name, sorted(known), n=1, cutoff=cutoff)
    return found[0] if found else None


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """``"; did you mean 'email.send'?"`` for the known name closest to ``name``, or
    ``""`` when none is close."""
    close = closest(name, known)
    return f"; did you mean {close!r}?" if close else ""


def note_served(names: Iterable[str]) -> None:
    """Remember effect names a dispatcher of this process runs (``Dispatcher`` and
    ``AsyncDispatcher`` call this when built)."""
    global _served
    with _lock:
        _served = _served | frozenset(names)


def register_effects(*effects: Any) -> None:
    """Allow these effects at ``enqueue`` (from now on, every one not registered is
    refused): ``Effect`` classes or instances (their ``name``, and their
    ``payload_model`` checks the payload) or effect names. Registering a name again
    replaces its model."""
    found: dict[str, type[BaseModel] | None] = {}
    for effect in effects:
        if isinstance(effect, str):
            if not effect.strip():
                raise ValueError("an effect name must not be empty")
            found[effect] = None
            continue
        name = getattr(effect, "name", None)
        if not isinstance(name, str) or not name:
            raise TypeError(f"register_effects() takes Effect classes, Effect instances or "
                            f"names, got {effect!r}"[:200])
        model = getattr(effect, "payload_model", None)
        if model is not None and not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise TypeError(f"{name!r}: payload_model must be a pydantic model class")
        found[name] = model
    global _registered
    with _lock:
        _registered = MappingProxyType({**_registered, **found})


def registered_effects() -> Mapping[str, type[BaseModel] | None]:
    """The registered effect names and their payload models (None: any mapping)."""
    return _registered


def clear_registered_effects() -> None:
    """Forget every registration: ``enqueue`` takes any effect name again."""
    global _registered
    with _lock:
        _registered = MappingProxyType({})


def check(effect: str, payload: object) -> None:
    """Refuse an unregistered effect or a payload its model rejects (no-op when nothing
    is registered)."""
    registered = _registered
    if not registered:
        served = _served
        if served and effect not in served and effect not in _hinted:
            _hint(effect, served)
        return
    if effect not in registered:
        raise UnknownEffect(
            f"effect {effect!r} is not registered (registered: "
            f"{', '.join(sorted(registered))}){did_you_mean(effect, registered)}")
    model = registered[effect]
    if model is None or isinstance(payload, model):
        return
    if isinstance(payload, BaseModel):
        raise InvalidPayload(f"payload for {effect!r} must be a {model.__name__} (or a "
                             f"mapping of its fields), got a {type(payload).__name__}")
    try:
        model.model_validate(payload)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'payload'}: {e['msg']}"
            for e in exc.errors(include_input=False, include_url=False, include_context=False))
        raise InvalidPayload(f"payload invalid for effect {effect!r} "
                             f"({model.__name__}): {problems}") from None


def _hint(effect: str, served: frozenset[str]) -> None:
    """Warn once that ``effect`` looks like a typo of an effect this process's
    dispatchers run (nothing when no served name is close: it may be another's)."""
    close = closest(effect, served, HINT_CUTOFF)
    with _lock:
        if effect in _hinted:
            return
        _hinted.add(effect)
    if close is None:
        return
    log.warning(
        "enqueued a job of effect %r, which no dispatcher of this process runs; did you "
        "mean %r? The job waits for a dispatcher that runs %r (a misspelt name waits "
        "forever: outbox status flags it; outbox.register_effects(...) makes enqueue "
        "refuse names it does not know)", effect, close, effect)
