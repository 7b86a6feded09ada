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
"""

from __future__ import annotations

import difflib
import threading
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from pydantic import BaseModel, ValidationError

from .errors import InvalidPayload, UnknownEffect

__all__ = ["clear_registered_effects", "register_effects", "registered_effects"]

_lock = threading.Lock()
# Replaced whole on each change, so enqueue reads it without the lock.
_registered: Mapping[str, type[BaseModel] | None] = MappingProxyType({})


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
        return
    if effect not in registered:
        close = difflib.get_close_matches(effect, list(registered), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise UnknownEffect(
            f"effect {effect!r} is not registered (registered: "
            f"{', '.join(sorted(registered))}){hint}")
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
