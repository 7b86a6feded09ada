"""The lifecycle's rule of a parent's settlement (``_lifecycle.PARENT_SETTLED``) as SQL.

The fragment ``after_released`` (``sql/after.sql``) settles every child of the parents a
statement settles, set-based, in that statement. What it writes to each child (status,
``last_error``, ``available_at``) is not written in SQL by hand: ``parent_fragments``
renders the rule's cases as three CASE expressions, the fragments ``parent_status``,
``parent_error`` and ``parent_available_at``, which ``outbox._sql`` binds with the core's
fragments when it loads the SQL. A CASE takes its first WHEN that holds, as
``parent_settled`` takes the first case that holds, so the statement applies the very
decision the function returns; a test evaluates both for every case, and for altered
rules.

Each fact the rule names is read in the fragment from ``AFTER_RELEASED_FACTS``: the child's
row (``j``), its count of the edges resolved (``c``), the parents the statement settles
(the CTE ``parents``). A condition on a fact that may be NULL tests it with ``IS NOT
NULL`` only (``_lifecycle.check_parent_rule``), so SQL's three-valued logic and Python's
agree.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from ._lifecycle import (
    PARENT_SETTLED,
    AtMost,
    Condition,
    Equals,
    ErrorPart,
    Fact,
    Given,
    ParentCase,
    Said,
    check_parent_rule,
)

__all__ = ["AFTER_RELEASED_FACTS", "KEPT", "parent_fragments"]

AFTER_RELEASED_FACTS: Mapping[Fact, str] = {
    "mode": "j.after_failed",
    "waiting": "j.after_waiting",
    "settled": "c.n",
    "failed": "c.failed",
    # Read only where the error is written: a child whose parents are done costs nothing.
    "failed_error": "(SELECT p.error FROM parents p WHERE p.key = c.failed)",
}
"""Where ``after_released`` reads each fact of the rule (see its comment in ``after.sql``):
the values before the statement's update, as SQL's SET reads them."""
KEPT = {"error": "j.last_error", "available_at": "j.available_at"}
"""What a case that keeps them writes: the child's error as it is (``error`` None), and its
``available_at`` while it still waits (``NEVER``: the fixed date of ``after_never``)."""


def parent_fragments(rule: tuple[ParentCase, ...] = PARENT_SETTLED,
                     facts: Mapping[Fact, str] = AFTER_RELEASED_FACTS) -> dict[str, str]:
    """The fragments ``parent_status``, ``parent_error`` and ``parent_available_at``:
    ``rule``'s cases as CASE expressions over ``facts``, each a WHEN per case in order, the
    last (which holds always) the ELSE. ``ValueError`` for a rule ``check_parent_rule``
    refuses, or a text SQL text cannot hold as it is bound (``%``, ``{``, ``}``)."""
    check_parent_rule(rule)
    whens = [_condition(case.when, facts) for case in rule]

    def case_of(values: list[str]) -> str:
        branches = " ".join(f"WHEN {w} THEN {v}"
                            for w, v in zip(whens[:-1], values[:-1], strict=True))
        return f"(CASE {branches} ELSE {values[-1]} END)" if branches else f"({values[-1]})"

    return {
        "parent_status": case_of([_literal(case.status) for case in rule]),
        "parent_error": case_of([KEPT["error"] if case.error is None
                                 else _error(case.error, facts) for case in rule]),
        "parent_available_at": case_of([_available_at(case.delay) for case in rule]),
    }


def _condition(when: tuple[Condition, ...], facts: Mapping[Fact, str]) -> str:
    if not when:
        return "true"
    return " AND ".join(f"({_test(condition, facts)})" for condition in when)


def _test(condition: Condition, facts: Mapping[Fact, str]) -> str:
    if isinstance(condition, Given):
        return f"{facts[condition.fact]} IS NOT NULL"
    if isinstance(condition, Equals):
        value = condition.value
        literal = _literal(value) if isinstance(value, str) else str(int(value))
        return f"{facts[condition.fact]} = {literal}"
    assert isinstance(condition, AtMost)
    return f"{facts[condition.fact]} <= {facts[condition.other]}"


def _error(parts: tuple[ErrorPart, ...], facts: Mapping[Fact, str]) -> str:
    pieces = []
    for part in parts:
        if isinstance(part, str):
            pieces.append(_literal(part))
        elif isinstance(part, Said):
            pieces.append(f"CAST({facts[part.fact]} AS text)")
        else:
            shown = f"left(CAST({facts[part.fact]} AS text), {int(part.limit)})"
            pieces.append(f"coalesce({_literal(part.before)} || {shown} || "
                          f"{_literal(part.after)}, '')")
    return " || ".join(pieces) if pieces else "''"


def _available_at(delay: float) -> str:
    if math.isinf(delay):
        return KEPT["available_at"]
    if not delay >= 0:
        raise ValueError(f"a case's delay must be 0 or more seconds, or NEVER, got {delay}")
    if delay == 0:
        return "now()"
    return f"now() + {float(delay)!r} * interval '1 second'"


def _literal(text: str) -> str:
    """``text`` as an SQL string literal, for a statement whose parameters are bound by
    name (so no ``%``) and whose fragments are bound by ``{name}`` (so no braces)."""
    bad = sorted({c for c in text if c in "%{}"})
    if bad or "\x00" in text:
        raise ValueError(f"a text of the rule cannot hold {bad or ['NUL']} (it is bound "
                         f"into SQL as it is): {text!r}")
    return "'" + text.replace("'", "''") + "'"
