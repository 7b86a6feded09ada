"""Supervision: every part runs supervised, so its unexpected death stops the dispatcher
loudly (``SharedState.fail``) instead of leaving it silently degraded; and ``guarded``,
how an observer's error is kept from changing what happens to a job."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

__all__ = ["Failing", "guarded", "supervised", "supervised_async"]

log = logging.getLogger("outbox.dispatcher")


class Failing(Protocol):
    """What a supervised part reports its death to (the dispatcher's ``SharedState``)."""

    def fail(self, part: str, error: BaseException) -> None: ...

_reported: set[str] = set()


def guarded(method: Callable[..., None], *args: object) -> None:
    """Call an observer method; an ``Exception`` it raises is logged and ignored (the
    first time per method with its traceback), so observing never changes what happens
    to a job. A ``BaseException`` (SystemExit, KeyboardInterrupt) is not swallowed: it
    ends the part that called, which the dispatcher's supervision reports."""
    try:
        method(*args)
    except Exception:
        name = getattr(method, "__qualname__", repr(method))
        if name not in _reported:
            _reported.add(name)
            log.exception("observer %s raised; ignored (further errors of it logged once "
                          "per event at debug level)", name)
        else:
            log.debug("observer %s raised; ignored", name, exc_info=True)


def supervised(state: Failing, part: str, body: Callable[[], None]) -> Callable[[], None]:
    """``body`` as a thread target whose unexpected death stops the dispatcher loudly
    (``run`` and ``run_until_idle`` then raise) instead of leaving it silently degraded."""

    def target() -> None:
        try:
            body()
        except BaseException as exc:
            state.fail(part, exc)

    return target


async def supervised_async(state: Failing, part: str, body: Awaitable[None]) -> None:
    """Await ``body`` (a part's task); its unexpected death stops the dispatcher loudly,
    as ``supervised`` does for a thread. Cancellation is not a death: it is re-raised."""
    try:
        await body
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # reported, then the dispatcher stops
        state.fail(part, exc)
