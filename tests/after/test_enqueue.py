"""What enqueue accepts and refuses for fan-in, and what it writes: parents must exist
(a job in this transaction or an earlier one, or a ledger row), never the job itself, and
in a batch only earlier entries; a child of a parent failed for good fails at once."""

from __future__ import annotations

from datetime import timedelta

import psycopg
import pytest

import outbox
from outbox import NewJob

from .support import job_row


def _enqueue(dsn: str, schema: str, *jobs: NewJob) -> list[outbox.EnqueueResult]:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        return tx.enqueue_many(jobs)


def _job(key: str, after: list[str] | None = None, **options: str) -> NewJob:
    return NewJob("test.work", key=key, payload={}, after=after, **options)  # type: ignore[arg-type]


def _count(dsn: str, schema: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(f'SELECT count(*) FROM "{schema}".jobs').fetchone()
    assert row is not None
    return int(row[0])


def test_a_key_that_names_nothing_is_refused_and_nothing_is_written(
        dsn: str, schema: str) -> None:
    _enqueue(dsn, schema, _job("known"))
    with psycopg.connect(dsn) as conn, pytest.raises(outbox.UnknownParent) as refused, \
                outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue("test.work", key="child", payload={}, after=["known", "typo-key"])
    assert refused.value.keys == ["typo-key"]
    assert "'typo-key'" in str(refused.value) and "'child'" in str(refused.value)
    assert isinstance(refused.value, outbox.EnqueueError)
    assert _count(dsn, schema) == 1


def test_a_caught_refusal_leaves_no_job_behind(dsn: str, schema: str) -> None:
    """The check runs before the insert: a caller that catches the error and commits
    the rest of its transaction commits no child that would run without waiting."""
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        with pytest.raises(outbox.UnknownParent):
            tx.enqueue("test.work", key="child", payload={}, after=["nothing"])
        tx.enqueue("test.work", key="other", payload={})
    assert _count(dsn, schema) == 1


@pytest.mark.parametrize(("after", "options", "says"), [
    (["child"], {}, "own key"),
    ("parent", {}, "list of job keys"),
    ([""], {}, "after[0] must not be empty"),
    ([42], {}, "after[0] must be a string"),
    (["parent"], {"after_failed": "ignore"}, "after_failed must be 'fail'"),
    (["parent"], {"run_at": "soon"}, "run_at and after cannot be combined"),
])
def test_bad_after_arguments_are_refused_naming_what_is_wrong(
        dsn: str, schema: str, after: object, options: dict[str, object], says: str) -> None:
    _enqueue(dsn, schema, _job("parent"))
    if options.get("run_at") == "soon":
        options = {**options, "run_at": timedelta(minutes=1)}
    with psycopg.connect(dsn) as conn, pytest.raises(outbox.EnqueueError) as refused, \
            outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue("test.work", key="child", payload={}, after=after,  # type: ignore[arg-type]
                   **options)  # type: ignore[arg-type]
    assert says in str(refused.value)


def test_a_batch_may_name_earlier_entries_only(dsn: str, schema: str) -> None:
    results = _enqueue(dsn, schema, _job("a"), _job("b", ["a"]), _job("c", ["a", "b"]))
    assert all(r.created for r in results)
    assert job_row(dsn, schema, "c")["after_waiting"] == 2
    with pytest.raises(outbox.InvalidArgument, match="must come before"):
        _enqueue(dsn, schema, _job("x", ["y"]), _job("y"))


def test_parents_in_the_same_transaction_are_waited_for(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue("test.work", key="p", payload={})
        tx.enqueue("test.work", key="c", payload={}, after=["p", "p"])  # named twice: once
    child = job_row(dsn, schema, "c")
    assert (child["status"], child["after_waiting"], child["after_failed"]) == (
        "pending", 1, "fail")


def test_a_repeated_enqueue_of_a_child_adds_no_parents(dsn: str, schema: str) -> None:
    """No cycle can be built: a key that is already a job never gains parents."""
    _enqueue(dsn, schema, _job("a"), _job("b"))
    again = _enqueue(dsn, schema, _job("a", ["b"]))
    assert not again[0].created
    assert job_row(dsn, schema, "a")["after_waiting"] == 0


def test_a_parent_failed_for_good_fails_a_new_child_at_once_unless_it_runs_anyway(
        dsn: str, schema: str) -> None:
    _enqueue(dsn, schema, _job("p"), _job("done-p"))
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"""UPDATE "{schema}".jobs SET status = 'failed',
                         last_error = 'Permanent: card declined' WHERE key = 'p'""")
    _enqueue(dsn, schema, _job("fails", ["p"]), _job("runs", ["p"], after_failed="run"))
    failed = job_row(dsn, schema, "fails")
    assert failed["status"] == "failed"
    assert "parent p failed for good" in failed["last_error"]
    assert "card declined" in failed["last_error"]
    runs = job_row(dsn, schema, "runs")
    assert (runs["status"], runs["after_waiting"]) == ("pending", 0)
