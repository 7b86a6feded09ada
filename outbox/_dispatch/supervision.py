"""Supervision: every part runs supervised, so its unexpected death stops the dispatcher
loudly (``SharedState.fail``) instead of leaving it silently degraded; and ``guarded``,
how an observer's error is kept from changing what happens to a job.

The rule is written once, as a program of ``runtime`` (``supervising``): a part that is
a program is supervised as it is, on a thread (``drive``) or as a task (``drive_async``);
``supervised`` makes a thread target of a plain function (the workers' threads)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from .runtime import Call, Program, drive

__all__ = ["Failing", "guarded", "supervised", "supervising"]

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


def supervising(state: Failing, part: str, program: Program[None],
                passes: tuple[type[BaseException], ...] = (asyncio.CancelledError,),
                ) -> Program[None]:
    """``program`` (a part's loop, or one pass of it), supervised: whatever it dies of,
    ``BaseException`` included, is reported (``state.fail``: the dispatcher stops and
    its run raises ``DispatcherFailed``) instead of propagating. ``passes``: what is not
    a death and propagates (a cancellation; for a pass run on the caller's own thread or
    task, its ``KeyboardInterrupt`` too)."""
    try:
        yield from program
    except passes:
        raise
    except BaseException as exc:  # reported, then the dispatcher stops
        state.fail(part, exc)


def supervised(state: Failing, part: str, body: Callable[[], None]) -> Callable[[], None]:
    """``body`` as a thread target, supervised (``supervising``; a thread is never
    cancelled: whatever ends it is a death)."""
    return lambda: drive(supervising(state, part, _calling(body), ()))


def _calling(body: Callable[[], None]) -> Program[None]:
    yield Call(body)
