"""Which completion hooks and reconcilers a dispatcher has, checked once at build time.

An effect has a hook when it overrides ``Effect.on_done`` / ``on_failed`` or when the
dispatcher was given one for its name (``on_done={"payment.charge": fn}``), which then
takes the method's place. Effects without hooks keep the recorder's batched path.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from ..effect import Effect
from ..errors import ConfigurationError

__all__ = ["hooks_for", "is_async_hook", "overrides", "require_sync_hooks"]


def overrides(effect: Effect, method: str) -> bool:
    """Whether ``effect``'s class defines ``method`` itself instead of ``Effect``'s no-op."""
    base = getattr(Effect, method)
    found = getattr(type(effect), method, base)
    return callable(found) and found is not base


def hooks_for(
    effects: Mapping[str, Effect], method: str, given: Mapping[str, Callable[..., Any]] | None,
) -> dict[str, Callable[..., Any]]:
    """The ``method`` hook (``on_done`` or ``on_failed``) of each effect that has one."""
    hooks: dict[str, Callable[..., Any]] = {
        name: getattr(effect, method) for name, effect in effects.items()
        if overrides(effect, method)}
    if given is None:
        return hooks
    if not isinstance(given, Mapping):
        raise ConfigurationError(
            f"{method} must map effect names to functions, got {type(given).__name__}")
    for name, fn in given.items():
        if name not in effects:
            raise ConfigurationError(
                f"{method}={{{name!r}: ...}} names no effect of this dispatcher "
                f"(it has {', '.join(sorted(effects))})")
        if not callable(fn):
            raise ConfigurationError(
                f"{method}[{name!r}] must be a function (tx, job, value), "
                f"got {type(fn).__name__}")
        hooks[name] = fn
    return hooks


def is_async_hook(fn: Callable[..., Any]) -> bool:
    """Whether the hook is an ``async def`` (awaited on ``AsyncDispatcher``)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None))  # noqa: B004 - an object with async __call__


def require_sync_hooks(*hook_maps: Mapping[str, Callable[..., Any]]) -> None:
    """``Dispatcher`` runs hooks on its recorder thread: an ``async def`` hook needs
    ``AsyncDispatcher``."""
    for hooks in hook_maps:
        for name, fn in hooks.items():
            if is_async_hook(fn):
                raise ConfigurationError(
                    f"the completion hook of effect {name!r} is async def: use "
                    "outbox.AsyncDispatcher, or make the hook a plain function")
