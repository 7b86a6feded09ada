"""Provider limits: how fast, and how many at once, an effect may be performed.

A limit belongs to the provider account, so it is counted in PostgreSQL (the table
``effect_limits``) and shared by every dispatcher process on the schema, or, declared
``shared``, in one limits home for every target (database or schema) that names it; see
``Limit``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["Limit", "parse_limit"]


@dataclass(frozen=True, slots=True)
class Limit:
    """At most ``rate`` performs per second and ``concurrency`` performs in flight of one
    effect, counted across every dispatcher process on the schema.

    Guarantees: jobs of a limited effect are claimed (their leases taken) no faster than
    the budget allows: a token bucket of ``rate`` tokens per second holding at most
    ``burst`` (by default half a second's worth, at least 1), spent at the claim, and no
    more running jobs of the effect than ``concurrency`` (counted from the jobs table at
    each claim, under a lock on the effect's row, so two dispatchers never both take the
    last slot). A limited effect is claimed on its own, after the budget is checked, so a
    backlog of it never holds back the claims of other effects. When the provider
    throttles anyway (``outbox.Throttled``), the effective rate is cut and grows back
    additively, never above ``rate``.

    With ``per_group=True`` the rate, burst and concurrency apply to each group of the
    effect on its own (``group=`` at enqueue: a tenant, store or provider account; the
    jobs with no group are a group of their own), still counted in PostgreSQL and shared
    by every dispatcher process: each group has its own token bucket (a row in
    ``group_limits`` while the group is busy, swept a minute after it is idle) and no
    more than ``concurrency`` of its jobs run at once (``Limit(concurrency=3,
    per_group=True)`` is a concurrency of 3 per key). A ``Throttled`` then pauses and
    slows only the group whose job the provider refused; the effect's other groups go
    on. No limit applies to the effect as a whole: the fair claim shares the
    dispatcher's capacity between the groups.

    With ``shared=True`` the rate and burst are counted across databases: one provider
    account used by many targets (tenant databases or schemas, ``outbox.Target``) is held
    to one rate, whichever target and dispatcher process claims. The token bucket lives
    in the dispatcher's ``limits_home`` (an ``outbox.Target``: an outbox schema every
    dispatcher sharing the limit names, migrated with ``outbox migrate``); a claim in any
    target takes its tokens there first, claims at most that many jobs, and gives back
    what it did not use. A ``Throttled`` seen in any target pauses the shared bucket, so
    every target backs off. A ``concurrency`` given with it is still counted in each
    target on its own. If the home cannot be reached, no job of the effect is claimed
    (anywhere it is shared) until it can: the other effects go on.

    Declare it on the dispatcher (``Dispatcher(..., limits={"email.send":
    Limit(rate=2.0)})``) or as the effect's own default (``limit = Limit(rate=2.0)`` on
    the ``Effect`` class); the dispatcher's wins. A dispatcher that does not declare the
    effect's limit still honours it for a minute after any dispatcher last claimed
    under it.

    :param rate: Performs per second (claims of the effect's jobs); None: no rate.
    :param burst: The most tokens the bucket holds (performs at once after a pause);
        None: half a second's worth, at least 1.
    :param concurrency: The most jobs of the effect running at once, across every
        dispatcher; None: no such bound.
    :param per_group: Apply the rate, burst and concurrency to each ``group`` on its own.
    :param shared: Count the rate and burst across targets, in the dispatcher's
        ``limits_home``.
    """

    rate: float | None = None
    burst: float | None = None
    concurrency: int | None = None
    per_group: bool = False
    shared: bool = False

    def __post_init__(self) -> None:
        for name in ("rate", "burst"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not (
                    math.isfinite(value) and value > 0):
                raise ValueError(f"Limit({name}=...) must be a positive number, got {value!r}")
        if self.burst is not None and self.burst < 1:
            raise ValueError(f"Limit(burst=...) must be at least 1, got {self.burst!r}")
        if self.burst is not None and self.rate is None:
            raise ValueError("Limit(burst=...) needs a rate: a burst is of the rate's tokens")
        if self.concurrency is not None and (
                isinstance(self.concurrency, bool) or not isinstance(self.concurrency, int)
                or self.concurrency < 1):
            raise ValueError(
                f"Limit(concurrency=...) must be a positive integer, got {self.concurrency!r}")
        if self.rate is None and self.concurrency is None:
            raise ValueError("a Limit needs a rate, a concurrency or both")
        if not isinstance(self.per_group, bool):
            raise ValueError(f"Limit(per_group=...) must be True or False, got {self.per_group!r}")
        if not isinstance(self.shared, bool):
            raise ValueError(f"Limit(shared=...) must be True or False, got {self.shared!r}")
        if self.shared and self.rate is None:
            raise ValueError("Limit(shared=True) needs a rate: what is shared across targets "
                             "is a rate (a concurrency is counted in each target)")
        if self.shared and self.per_group:
            raise ValueError("Limit(shared=True) and per_group=True cannot be combined: a "
                             "shared limit counts the effect as a whole across targets")

    def __str__(self) -> str:
        parts = []
        if self.rate is not None:
            parts.append(f"{self.rate:g}/s")
        if self.burst is not None:
            parts.append(f"burst={self.burst:g}")
        if self.concurrency is not None:
            parts.append(f"concurrency={self.concurrency}")
        if self.per_group:
            parts.append("per_group")
        if self.shared:
            parts.append("shared")
        return ",".join(parts)


_RATE = re.compile(r"^(?P<n>[0-9]*\.?[0-9]+)\s*/\s*(?P<unit>s|sec|second|m|min|minute|h|hour)$")
_PER = {"s": 1.0, "sec": 1.0, "second": 1.0, "m": 60.0, "min": 60.0, "minute": 60.0,
        "h": 3600.0, "hour": 3600.0}


def parse_limit(text: str) -> Limit:
    """A ``Limit`` from its command-line form: comma-separated parts, a rate (``2/s``,
    ``100/m``, ``1000/h``), ``burst=N``, ``concurrency=N``, ``per_group`` (the limit
    applies to each group on its own) and ``shared`` (the rate is counted across targets,
    in the dispatcher's limits home). ``ValueError`` says which part is wrong."""
    rate: float | None = None
    burst: float | None = None
    concurrency: int | None = None
    per_group = False
    shared = False
    for raw in text.split(","):
        part = raw.strip()
        if not part:
            raise ValueError(f"empty part in limit {text!r}")
        if part == "per_group":
            per_group = True
            continue
        if part == "shared":
            shared = True
            continue
        name, sep, value = part.partition("=")
        if sep:
            name = name.strip()
            try:
                if name == "burst":
                    burst = float(value)
                elif name == "concurrency":
                    concurrency = int(value)
                else:
                    raise ValueError(f"unknown limit part {name!r} in {text!r} "
                                     "(expected a rate like 2/s, burst=N, concurrency=N, "
                                     "per_group or shared)")
            except ValueError as exc:
                if "unknown limit part" in str(exc):
                    raise
                raise ValueError(f"{name} in limit {text!r} must be a number, "
                                 f"got {value.strip()!r}") from None
            continue
        match = _RATE.match(part)
        if match is None:
            raise ValueError(f"cannot read {part!r} in limit {text!r}: give a rate like "
                             "2/s or 100/m, burst=N, concurrency=N, per_group or shared")
        rate = float(match["n"]) / _PER[match["unit"]]
    return Limit(rate=rate, burst=burst, concurrency=concurrency, per_group=per_group,
                 shared=shared)
