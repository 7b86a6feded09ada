"""The SQL a parent's settlement runs is rendered from the lifecycle's rule, and follows it.

PostgreSQL evaluates the CASE expressions rendered from a rule (``outbox._rule_sql``) for
every combination of the facts, and each child's status, error and due time must be what
``parent_settled`` decides with the same rule: for the rule as shipped and for altered
ones. Then the real statements (the recorder's ``settle``, the sweep), bound from an
altered rule, settle real children as that rule decides, not as the shipped one.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from psycopg import sql

import outbox
from outbox import Job, NewJob
from outbox._dispatch.settling import settle_claim, settle_claims
from outbox._lifecycle import (
    NEVER,
    PARENT_SETTLED,
    AtMost,
    Decision,
    Equals,
    Given,
    Mode,
    ParentCase,
    Quoted,
    Said,
    parent_settled,
)
from outbox._rule_sql import parent_fragments
from outbox._sql import bind_blocks, core_fragments, read_sql
from outbox.sql import queries

from ..integration.helpers import table

ANY_FAILURE = (
    ParentCase((Given("failed"),), "failed", 0.0,
               ("parent '", Said("failed"), "' failed", Quoted("failed_error", ": ", "", 10)),
               "any failed parent fails the child, whatever its mode"),
    *PARENT_SETTLED[1:],
)
RELEASE_FIRST_LATER = (
    ParentCase((AtMost("waiting", "settled"),), "pending", 90.0, ("released late",),
               "the last parent settled: due in 90 s, whatever it was"),
    ParentCase((Given("failed"), Equals("mode", "fail"), Equals("waiting", 2)), "failed",
               0.0, None, "a failed parent of two fails a child saying fail, error kept"),
    ParentCase((), "pending", NEVER, None, "else: waiting"),
)
RULES = {"shipped": PARENT_SETTLED, "any-failure": ANY_FAILURE,
         "release-first-later": RELEASE_FIRST_LATER}
# The parents settled in the statement, by key, with their errors: quotes, none, and one
# longer than any quote in characters of two bytes.
PARENTS = {"p-err": "Permanent: it's 'declined'", "p-none": None, "p-long": "é" * 250}
EVALUATE = """
WITH parents AS (
    SELECT * FROM jsonb_to_recordset(%(parents)s::jsonb) AS p(key text, error text)
)
SELECT v.i, {parent_status} AS status, {parent_error} AS error,
       CASE WHEN ({parent_available_at}) = j.available_at THEN NULL
            ELSE extract(epoch FROM ({parent_available_at}) - now()) END AS delay
FROM jsonb_to_recordset(%(grid)s::jsonb)
     AS v(i integer, after_failed text, after_waiting integer, n bigint, failed text)
CROSS JOIN LATERAL (SELECT v.after_failed, v.after_waiting, 'earlier'::text AS last_error,
                           timestamptz '2100-01-01 00:00:00+00' AS available_at) AS j
CROSS JOIN LATERAL (SELECT v.n, v.failed) AS c
ORDER BY v.i
"""


def _evaluated(dsn: str, rule: tuple[ParentCase, ...]) -> set[tuple[str, float]]:
    """PostgreSQL's evaluation of ``rule`` rendered, over every combination of the facts,
    asserted equal to ``parent_settled``'s with the same rule; the (status, delay)
    decisions met."""
    modes: tuple[Mode, ...] = ("fail", "run")
    cases = list(itertools.product(modes, (1, 2, 3), (1, 2, 3), (None, *PARENTS)))
    grid = [{"i": i, "after_failed": mode, "after_waiting": waiting, "n": settled,
             "failed": failed} for i, (mode, waiting, settled, failed) in enumerate(cases)]
    statement = bind_blocks({"q": EVALUATE}, "unused", parent_fragments(rule))["q"]
    parents = [{"key": key, "error": error} for key, error in PARENTS.items()]
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(statement, {"grid": json.dumps(grid),
                                        "parents": json.dumps(parents)}).fetchall()
    assert len(rows) == len(cases) == 72
    met: set[tuple[str, float]] = set()
    for case, (_, status, error, delay) in zip(cases, rows, strict=True):
        mode, waiting, settled, failed = case
        decision = parent_settled(mode, waiting, failed,
                                  PARENTS[failed] if failed else None,
                                  settled=settled, rule=rule)
        assert status == decision.status, case
        assert error == (decision.error if decision.error is not None else "earlier"), case
        if decision.delay == NEVER:
            assert delay is None, case
        else:
            assert delay is not None and float(delay) == pytest.approx(decision.delay), case
        met.add((decision.status, decision.delay))
    return met


@pytest.mark.parametrize("name", list(RULES))
def test_postgresql_evaluates_the_rendered_rule_as_parent_settled_decides(
        dsn: str, name: str) -> None:
    assert len(_evaluated(dsn, RULES[name])) > 1  # the grid reaches several cases


# Rules of any shape the vocabulary can state: conditions on every fact, errors quoting
# and saying them (a nullable one said only where its case tested it), any delay.
NUMBERS = st.sampled_from(["waiting", "settled"])
conditions = st.one_of(
    st.builds(Given, st.sampled_from(["failed", "failed_error"])),
    st.builds(Equals, st.just("mode"), st.sampled_from(["fail", "run"])),
    st.builds(Equals, NUMBERS, st.integers(0, 4)),
    st.builds(AtMost, NUMBERS, NUMBERS),
)
texts = st.text(alphabet="ab '\"é:()-", max_size=8)
parts = st.one_of(
    texts,
    st.builds(Said, st.sampled_from(["mode", "waiting", "settled", "failed"])),
    st.builds(Quoted, st.sampled_from(["failed", "failed_error", "mode", "waiting"]), texts,
              texts, st.integers(0, 30)),
)


@st.composite
def parent_cases(draw: st.DrawFn, *, last: bool = False) -> ParentCase:
    when = () if last else tuple(draw(st.lists(conditions, min_size=1, max_size=3)))
    given = {c.fact for c in when if isinstance(c, Given)}
    error = draw(st.none() | st.lists(parts, max_size=4).map(tuple))
    if error is not None:  # a nullable fact is said only where its case tested it
        error = tuple(p for p in error if not isinstance(p, Said) or p.fact != "failed"
                      or "failed" in given)
    return ParentCase(when, draw(st.sampled_from(["pending", "failed", "reconcile"])),
                      draw(st.sampled_from([0.0, NEVER, 1.5, 3600.0])), error, "drawn")


rules = st.builds(lambda cases, last: (*cases, last),
                  st.lists(parent_cases(), max_size=4), parent_cases(last=True))


@settings(max_examples=40, deadline=None, database=None)
@given(rule=rules)
def test_postgresql_evaluates_any_rendered_rule_as_parent_settled_decides(
        dsn: str, rule: tuple[ParentCase, ...]) -> None:
    _evaluated(dsn, rule)


# -- the real statements, bound from an altered rule ------------------------------------------


def _bound(path: str, name: str, schema: str, rule: tuple[ParentCase, ...]) -> str:
    """Statement ``name`` of ``path`` bound as the product binds it, ``rule`` rendered."""
    fragments = {**core_fragments(), **parent_fragments(rule)}
    return bind_blocks(read_sql("outbox", path).blocks, schema, fragments)[name]


def _children(dsn: str, schema: str, parent: str) -> None:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue_many([NewJob("test.parent", parent, {})])
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue_many([NewJob("test.child", f"{parent}-{mode}", {}, after=[parent],
                                after_failed=mode) for mode in ("fail", "run")])


def _states(conn: psycopg.Connection[Any], schema: str, parent: str,
            ) -> dict[Mode, tuple[str, str | None, bool]]:
    """Each child's status, error, and whether it is due now."""
    rows = conn.execute(sql.SQL(
        "SELECT after_failed, status, last_error, available_at <= now() FROM {} "
        "WHERE key LIKE %s").format(table(schema, "jobs")), (f"{parent}-%",)).fetchall()
    return {row[0]: (row[1], row[2], row[3]) for row in rows}


def _decided(parent: str, error: str | None) -> dict[Mode, tuple[str, str | None, bool]]:
    """What the altered rule decides for each child of ``parent`` failed with ``error``
    (and, for the child saying "run", not what the shipped rule decides)."""
    modes: tuple[Mode, ...] = ("fail", "run")
    decided = {mode: parent_settled(mode, 1, parent, error, rule=ANY_FAILURE)
               for mode in modes}
    assert parent_settled("run", 1, parent, error).status == "pending"
    assert decided["run"].status == "failed"
    return {mode: (d.status, d.error, d.delay == 0) for mode, d in decided.items()}


def test_the_recorders_settle_bound_from_an_altered_rule_settles_children_by_it(
        dsn: str, schema: str) -> None:
    _children(dsn, schema, "pa")
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.execute(queries(schema).claim, {
            "effects": ["test.parent"], "limit": 1, "lease": 300.0, "worker": "w",
            "after": "{}"}).fetchall()
        found = conn.execute(sql.SQL("SELECT id, claim_version FROM {} WHERE key = 'pa'")
                             .format(table(schema, "jobs"))).fetchone()
        assert found is not None
        job = Job(id=found[0], effect="test.parent", key="pa", payload={}, attempt=1,
                  claim_version=found[1])
        failed = Decision("failed", error="Permanent: no")
        settled = conn.execute(_bound("sql/record.sql", "settle", schema, ANY_FAILURE),
                               {"claims": settle_claims([settle_claim(job, failed)])})
        assert [row[0] for row in settled.fetchall()] == [job.id]
        assert _states(conn, schema, "pa") == _decided("pa", "Permanent: no")


def test_the_sweep_bound_from_an_altered_rule_settles_children_by_it(
        dsn: str, schema: str) -> None:
    _children(dsn, schema, "pb")
    with psycopg.connect(dsn, autocommit=True) as conn:
        # Settled behind the fan-in's back, as a settlement that could not see the edges.
        conn.execute(sql.SQL("UPDATE {} SET status = 'failed' WHERE key = 'pb'").format(
            table(schema, "jobs")))
        [row] = conn.execute(_bound("sql/after.sql", "after_sweep", schema, ANY_FAILURE),
                             {"child": 0, "parent": "", "limit": 1000}).fetchall()
        assert row[2] == 2  # both children woken
        assert _states(conn, schema, "pb") == _decided("pb", None)
