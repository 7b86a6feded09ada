"""Two sessions racing for one job: the double-claim trap, and fencing of stale claims.

The interleaving is forced, not hoped for: session A claims in an open transaction,
session B runs its statement in a thread, the test waits until PostgreSQL reports B
blocked on A's row lock (pg_stat_activity.wait_event_type = 'Lock'), then A commits.
"""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from psycopg import sql
from psycopg.rows import namedtuple_row

from outbox import Job, _lifecycle
from outbox.sql import queries
from outbox.testing import ledger

from .provider import EFFECT, Conn
from .support import connect, enqueue, job, session, table, wait_until, waiting_on_lock

Rows = list[tuple[Any, ...]]

NAIVE_INITPLAN = """
UPDATE {jobs} SET status = 'running', attempts = attempts + 1,
    claim_version = claim_version + 1, lease_until = now() + interval '30 seconds',
    claimed_by = %(worker)s::text, updated_at = now()
WHERE id = (SELECT id FROM {jobs} WHERE status = 'pending' AND effect = ANY(%(effects)s::text[])
            ORDER BY available_at, id LIMIT %(limit)s){guard}
RETURNING id, effect, key, payload, attempts, claim_version
"""
_LOCKING = "FOR UPDATE SKIP LOCKED"
# The claim locks in two places: each busy group's heads, and the top-up of what the
# groups' turns left of the claim. A variant edits both alike.
_CLAIM_LOCKS = 2
_GUARD = " AND j.status = 'pending'"


def _edit(text: str, old: str, new: str, count: int = 1) -> str:
    assert text.count(old) == count, (
        f"the shipped SQL no longer holds {count} {old!r}: update this test")
    return text.replace(old, new)


def _without_guard(claim: str) -> str:
    """The claim minus the UPDATE's own ``status = 'pending'`` (the CTE keeps its copy)."""
    cte, update = claim.split("\nUPDATE ", 1)
    return cte + "\nUPDATE " + _edit(update, _GUARD, "")


def _naive(schema: str, guard: str) -> str:
    return sql.SQL(NAIVE_INITPLAN).format(jobs=table(schema, "jobs"), guard=sql.SQL(guard)) \
        .as_string(None)


@dataclass(frozen=True)
class Claim:
    """A claim statement, and what happens when B runs it against A's claimed row."""

    sql: Callable[[str], str]
    b_waits: bool
    double_claim: bool


CLAIMS = {
    "shipped claim": Claim(lambda s: queries(s).claim, b_waits=False, double_claim=False),
    "shipped, FOR UPDATE without SKIP LOCKED": Claim(
        lambda s: _edit(queries(s).claim, _LOCKING, "FOR UPDATE", _CLAIM_LOCKS),
        b_waits=True, double_claim=False),
    "shipped, no locking clause: the UPDATE's guard alone": Claim(
        lambda s: _edit(queries(s).claim, _LOCKING, "", _CLAIM_LOCKS), b_waits=True,
        double_claim=False),
    "trap: no locking clause, no guard": Claim(
        lambda s: _without_guard(_edit(queries(s).claim, _LOCKING, "", _CLAIM_LOCKS)),
        b_waits=True, double_claim=True),
    "trap: id = (SELECT ...) InitPlan, no guard": Claim(
        lambda s: _naive(s, ""), b_waits=True, double_claim=True),
    "id = (SELECT ...) InitPlan with the guard": Claim(
        lambda s: _naive(s, " AND status = 'pending'"), b_waits=True, double_claim=False),
}


class Racer:
    """Runs one statement on its own autocommit connection in a thread."""

    def __init__(self, dsn: str) -> None:
        self.conn = connect(dsn)
        info = self.conn.execute("SELECT pg_backend_pid()").fetchone()
        assert info is not None
        self.pid: int = info[0]
        self.rows: Rows | None = None
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self, query: str, params: dict[str, Any]) -> None:
        def run() -> None:
            try:
                self.rows = self.conn.execute(query, params).fetchall()
            except BaseException as exc:  # handed to the test thread by join()
                self.error = exc

        self._thread = threading.Thread(target=run, name="session-B")
        self._thread.start()

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self) -> Rows:
        assert self._thread is not None
        self._thread.join(timeout=30)
        assert not self._thread.is_alive(), "session B is still blocked"
        if self.error is not None:
            raise self.error
        assert self.rows is not None
        return self.rows

    def close(self) -> None:
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.conn.close()


def _params(worker: str) -> dict[str, Any]:
    return {"effects": [EFFECT], "limit": 1, "lease": 30.0, "worker": worker, "after": "{}"}


@pytest.mark.parametrize("name", list(CLAIMS))
def test_double_claim_trap(dsn: str, schema: str, db: Conn, name: str) -> None:
    claim = CLAIMS[name]
    statement = claim.sql(schema)
    enqueue(db, schema, ["first", "second"])
    first = job(db, schema, "first")["id"]
    racer = Racer(dsn)
    try:
        with session(dsn) as a:
            [a_row] = a.execute(statement, _params("A")).fetchall()
            assert (a_row[0], a_row[5]) == (first, 1)
            racer.start(statement, _params("B"))
            if claim.b_waits:
                wait_until(lambda: waiting_on_lock(db, racer.pid), "B to block on A's row lock")
                assert racer.running()
            else:
                b_rows = racer.join()  # returns while A still holds its lock
            a.commit()
        if claim.b_waits:
            b_rows = racer.join()
    finally:
        racer.close()

    b_ids = [row[0] for row in b_rows]
    after = job(db, schema, "first")
    if claim.double_claim:
        # Both sessions got rowcount 1 for the same job: two workers now believe they
        # hold it and both would call the provider. The test can see the trap.
        assert b_ids == [first]
        assert (after["attempts"], after["claim_version"], after["claimed_by"]) == (2, 2, "B")
    else:
        assert first not in b_ids
        assert (after["attempts"], after["claim_version"], after["claimed_by"]) == (1, 1, "A")
    if name == "shipped claim":
        assert b_ids == [job(db, schema, "second")["id"]], "SKIP LOCKED moves on to the next"


# -- fencing --------------------------------------------------------------------------


def _claim(db: Conn, schema: str, worker: str) -> tuple[int, int]:
    [row] = db.execute(queries(schema).claim, _params(worker)).fetchall()
    return row[0], row[5]


def _expire_lease(db: Conn, schema: str, job_id: int) -> None:
    # Stands in for a worker stalled past its lease: the clock is not the subject here.
    db.execute(sql.SQL("UPDATE {} SET lease_until = now() - interval '1 second' WHERE id = %s")
               .format(table(schema, "jobs")), (job_id,))


class Fenced:
    """The dispatcher's fenced writes, as one worker holding ``version`` would send them."""

    def __init__(self, db: Conn, schema: str, job_id: int, version: int) -> None:
        self.db, self.q, self.id, self.version = db, queries(schema), job_id, version

    def _ids(self, query: str, claim: dict[str, Any], **params: Any) -> list[int]:
        claims = json.dumps([{"id": self.id, "version": self.version, **claim}])
        rows = self.db.execute(query, {"claims": claims, **params})
        return [row[0] for row in rows.fetchall()]

    def heartbeat(self) -> list[int]:
        return self._ids(self.q.heartbeat, {}, lease=30.0)

    def done(self, result: dict[str, Any]) -> list[int]:
        return self._ids(self.q.complete, {"result": result})

    def settle(self, status: str, *, refund: bool = False) -> list[int]:
        return self._ids(self.q.settle, {"status": status, "delay": 0.0,
                                         "error": f"stale {status}", "refund": refund})


def test_a_stale_claims_heartbeat_done_retry_and_fail_change_nothing(
    schema: str, db: Conn,
) -> None:
    enqueue(db, schema, ["k"])
    job_id, version = _claim(db, schema, "w1")
    _expire_lease(db, schema, job_id)
    assert _rescue(db, schema) == [(job_id, "pending", version)]
    db.execute(sql.SQL("UPDATE {} SET available_at = now() WHERE id = %s")  # its backoff
               .format(table(schema, "jobs")), (job_id,))
    assert _claim(db, schema, "w2") == (job_id, version + 1)

    stale, live = Fenced(db, schema, job_id, version), Fenced(db, schema, job_id, version + 1)
    assert stale.heartbeat() == []
    assert stale.done({"by": "w1"}) == []
    assert ledger(db, schema) == {}, "a stale done writes no ledger row"
    for status in ("pending", "failed", "reconcile"):
        assert stale.settle(status) == []
    assert stale.settle("pending", refund=True) == []
    held = job(db, schema, "k")
    assert (held["status"], held["claim_version"], held["attempts"]) == ("running", 2, 2)
    assert held["claimed_by"] == "w2"
    assert "lease expired on attempt 1 " in held["last_error"]

    assert live.heartbeat() == [job_id]
    assert live.done({"by": "w2"}) == [job_id]
    # Once done, neither claim can write again: there is no second completion.
    assert (live.done({"by": "again"}), live.settle("failed"), live.heartbeat()) == ([], [], [])
    assert (stale.done({"by": "w1"}), stale.heartbeat()) == ([], [])
    [row] = ledger(db, schema).values()
    assert (row["claim_version"], row["result"]) == (2, {"by": "w2"})
    assert job(db, schema, "k")["status"] == "done"


def _read_expired(db: Conn, schema: str, rescue: str) -> list[Any]:
    """The rescuer's read (``rescue``), as named rows."""
    with db.cursor(row_factory=namedtuple_row) as cur:
        rows: list[Any] = cur.execute(rescue, {"limit": 10}).fetchall()
        return rows


def _apply(db: Conn, schema: str, rows: list[Any], *, fenced: bool = True) -> Rows:
    """The rescuer's decisions for ``rows`` (``_lifecycle.expired``) applied by ``settle``
    as the dispatcher sends them (``fenced``: with ``expired``, the lease's fence);
    (id, status, claim_version) of each applied."""
    claims = []
    for row in rows:
        facts = Job(id=row.id, effect=row.effect, key=row.key, payload={},
                    attempt=row.attempts, claim_version=row.claim_version,
                    max_attempts=row.max_attempts, first_attempted_at=row.first_attempted_at)
        decision = _lifecycle.expired(facts, _lifecycle.Rules(window=86400.0), now=row.now,
                                      rng=random.Random(0), worker=row.claimed_by,
                                      cancelled=row.cancelled)
        claims.append({"id": row.id, "version": row.claim_version, "status": decision.status,
                       "delay": decision.delay, "error": decision.error, "refund": False,
                       **({"expired": True} if fenced else {})})
    if not claims:
        return []
    ids = [r[0] for r in db.execute(queries(schema).settle,
                                    {"claims": json.dumps(claims)}).fetchall()]
    return [(i, job_row(db, schema, i)["status"], v) for i, v in
            ((r.id, r.claim_version) for r in rows) if i in ids]


def job_row(db: Conn, schema: str, job_id: int) -> dict[str, Any]:
    row = db.execute(sql.SQL("SELECT key FROM {} WHERE id = %s").format(
        table(schema, "jobs")), (job_id,)).fetchone()
    assert row is not None
    return job(db, schema, str(row[0]))


def _rescue(db: Conn, schema: str) -> Rows:
    """One batch of the rescuer: read, decide, apply."""
    return _apply(db, schema, _read_expired(db, schema, queries(schema).rescue))


RESCUES: dict[str, tuple[Callable[[str], str], bool]] = {
    "shipped rescue: SKIP LOCKED passes the row being heartbeaten": (
        lambda s: queries(s).rescue, True),
    "rescue read without its locking clause: the apply's fence on the lease alone": (
        lambda s: _edit(queries(s).rescue, _LOCKING, ""), True),
    "trap: read unlocked, applied without the lease's fence": (
        lambda s: _edit(queries(s).rescue, _LOCKING, ""), False),
}


@pytest.mark.parametrize("name", list(RESCUES))
def test_rescuer_does_not_take_a_job_whose_heartbeat_committed_first(
    dsn: str, schema: str, db: Conn, name: str,
) -> None:
    """The rescue reads the expired claims, decides in Python, then applies: a heartbeat
    that commits between the read and the apply wins (the apply is fenced on the lease
    still being expired). The trap, applied without that fence, takes the renewed job."""
    read, fenced = RESCUES[name]
    rescue = read(schema)
    enqueue(db, schema, ["k"])
    job_id, version = _claim(db, schema, "w1")
    worker = Fenced(db, schema, job_id, version)

    _expire_lease(db, schema, job_id)
    assert worker.heartbeat() == [job_id]
    assert _read_expired(db, schema, rescue) == [], "a renewed lease is not rescued"

    _expire_lease(db, schema, job_id)
    reader = connect(dsn)
    try:
        with session(dsn) as heartbeat:
            beat = heartbeat.execute(queries(schema).heartbeat, {
                "claims": json.dumps([{"id": job_id, "version": version}]), "lease": 30.0,
            }).fetchall()
            assert beat == [(job_id, False)]  # renewed; no operator asked it to stop
            read_rows = _read_expired(reader, schema, rescue)  # never waits for the lock
            if name.startswith("shipped"):
                assert read_rows == [], "SKIP LOCKED: the rescuer passes the locked row"
            else:
                assert [r.id for r in read_rows] == [job_id], "read the expired version"
            heartbeat.commit()
        applied = _apply(reader, schema, read_rows, fenced=fenced)
    finally:
        reader.close()
    held = job(db, schema, "k")
    if not fenced:  # the trap: the renewed claim taken from its live worker
        assert applied == [(job_id, "pending", version)]
        assert held["status"] == "pending"
        return
    assert applied == []
    assert _rescue(db, schema) == []
    assert (held["status"], held["claim_version"], held["attempts"]) == ("running", 1, 1)
    lease_left = db.execute(sql.SQL("SELECT lease_until > now() + interval '20 seconds' FROM {}")
                            .format(table(schema, "jobs"))).fetchone()
    assert lease_left == (True,)
