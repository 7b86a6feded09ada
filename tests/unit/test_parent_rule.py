"""The rule of a parent's settlement as data (``_lifecycle.PARENT_SETTLED``): what
``parent_settled`` decides is the first case of its table that holds, the SQL is rendered
from the same table (``outbox._rule_sql``), and a table either cannot state is refused
when it is checked, saying which case is wrong. (PostgreSQL evaluating the rendered SQL
against the function: ``tests/after/test_parent_rule_sql.py``.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from outbox._lifecycle import (
    NEVER,
    PARENT_SETTLED,
    TRANSITIONS,
    AtMost,
    Decision,
    Equals,
    Given,
    ParentCase,
    Quoted,
    Said,
    check_parent_rule,
    parent_settled,
)
from outbox._rule_sql import parent_fragments
from outbox.sql import parse_sql

# Any failed parent fails the child, whatever its mode; the error quotes less.
ANY_FAILURE = (
    ParentCase((Given("failed"),), "failed", 0.0,
               ("parent '", Said("failed"), "' failed", Quoted("failed_error", ": ", "", 10)),
               "any failed parent fails the child"),
    *PARENT_SETTLED[1:],
)


def test_the_default_table_decides_as_its_cases_say() -> None:
    assert parent_settled("fail", 2, "p", "Permanent: " + "x" * 300) == Decision(
        "failed", error="not performed: parent p failed for good (Permanent: "
                        + "x" * 189 + ")")
    assert parent_settled("fail", 1, "p") == Decision(
        "failed", error="not performed: parent p failed for good")
    assert parent_settled("run", 1, "p", "no") == Decision("pending")
    assert parent_settled("run", 3, None, settled=3) == Decision("pending")
    assert parent_settled("fail", 3, None, settled=2) == Decision("pending", delay=NEVER)


def test_a_changed_table_changes_the_decision_and_the_sql_alike() -> None:
    default, changed = parent_fragments(), parent_fragments(ANY_FAILURE)
    assert parent_settled("run", 1, "p", "Permanent: declined", rule=ANY_FAILURE) == Decision(
        "failed", error="parent 'p' failed: Permanent:")
    assert parent_settled("run", 1, "p", "Permanent: declined").status == "pending"
    # The mode is no longer a condition of failing, in Python or in the SQL.
    assert "j.after_failed = 'fail'" in default["parent_status"]
    assert "j.after_failed" not in changed["parent_status"]
    assert "'parent ''' || CAST(c.failed AS text) || ''' failed'" in changed["parent_error"]
    assert "200" in default["parent_error"] and "10)" in changed["parent_error"]


def test_the_first_case_that_holds_decides() -> None:
    # The release first: a child whose last parent failed is released, not failed.
    release_first = (PARENT_SETTLED[1], PARENT_SETTLED[0], PARENT_SETTLED[2])
    assert parent_settled("fail", 1, "p", rule=release_first) == Decision("pending")
    assert parent_settled("fail", 2, "p", rule=release_first).status == "failed"
    status = parent_fragments(release_first)["parent_status"]
    assert status.index("<= c.n") < status.index("IS NOT NULL")


def test_a_delay_and_a_number_are_rendered() -> None:
    later = (ParentCase((Equals("waiting", 2), AtMost("waiting", "settled")), "pending", 90.0,
                        None, "two parents, both settled: due in 90 s"),
             ParentCase((), "pending", NEVER, None, "else: waiting"))
    assert parent_settled("run", 2, None, settled=2, rule=later) == Decision("pending",
                                                                             delay=90.0)
    assert parent_settled("run", 1, None, settled=1, rule=later).delay == NEVER
    fragments = parent_fragments(later)
    assert fragments["parent_available_at"] == (
        "(CASE WHEN (j.after_waiting = 2) AND (j.after_waiting <= c.n) THEN now() + 90.0 * "
        "interval '1 second' ELSE j.available_at END)")
    assert fragments["parent_error"] == (
        "(CASE WHEN (j.after_waiting = 2) AND (j.after_waiting <= c.n) THEN j.last_error "
        "ELSE j.last_error END)")


@pytest.mark.parametrize(("rule", "match"), [
    ((), "last case must hold always"),
    ((PARENT_SETTLED[0],), "last case must hold always"),
    ((ParentCase((Equals("failed", "p"),), "failed", 0.0, None, "compares a key"),
      PARENT_SETTLED[2]), r"case 0 .*\['failed'\], which may be None"),
    ((ParentCase((Equals("mode", "fail"),), "failed", 0.0, ("by ", Said("failed")),
                 "says a key it did not test"), PARENT_SETTLED[2]),
     r"case 0 .*\['failed'\]"),
    ((ParentCase((AtMost("waiting", "failed_error"),), "pending", 0.0, None, "x"),
      PARENT_SETTLED[2]), r"\['failed_error'\]"),
])
def test_a_table_the_sql_could_not_follow_is_refused(rule: tuple[ParentCase, ...],
                                                     match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_parent_rule(rule)
    with pytest.raises(ValueError, match=match):
        parent_fragments(rule)


@pytest.mark.parametrize("text", ["100% sure", "a {fragment}", "a }", "nul \x00"])
def test_a_text_sql_cannot_hold_as_it_is_bound_is_refused(text: str) -> None:
    rule = (ParentCase((Given("failed"),), "failed", 0.0, (text,), "x"), PARENT_SETTLED[2])
    assert parent_settled("fail", 1, "p", rule=rule).error == text  # Python could
    with pytest.raises(ValueError, match="a text of the rule cannot hold"):
        parent_fragments(rule)


def test_a_negative_delay_is_refused() -> None:
    rule = (ParentCase((), "pending", -1.0, None, "x"),)
    with pytest.raises(ValueError, match="delay must be 0 or more"):
        parent_fragments(rule)


def test_the_transitions_a_parents_settlement_makes_are_the_rules_cases() -> None:
    # Each status change the rule can make (pending to another) is a row of TRANSITIONS
    # (and so of the docs' table), decided by parent_settled, applied by after_released.
    changes = {case.status for case in PARENT_SETTLED if case.status != "pending"}
    listed = {t.after for t in TRANSITIONS if t.statement == "after_released"}
    assert changes == listed == {"failed"}
    assert {(t.source, t.decided_by) for t in TRANSITIONS
            if t.statement == "after_released"} == {("parent", "parent_settled")}


def test_the_rule_is_written_nowhere_else_in_the_products_sql() -> None:
    # Its texts and its test of the mode are in the lifecycle's table only: the SQL names
    # the rendered fragments, so no hand-written copy can drift from it.
    parsed = [parse_sql(path.read_text("utf-8"))
              for path in (Path(__file__).parents[2] / "outbox").rglob("*.sql")]
    sql_text = "\n".join(body for found in parsed  # the statements, comments left out
                         for body in (*found.blocks.values(), *found.fragments.values()))
    texts = [part for case in PARENT_SETTLED for part in case.error or ()
             if isinstance(part, str) and part.strip()]
    assert texts and not [text for text in texts if text in sql_text]
    assert "after_failed = 'fail'" not in sql_text
    assert "status = {parent_status}" in sql_text
