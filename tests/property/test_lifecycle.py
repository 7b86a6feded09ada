"""The job lifecycle as a state machine, on real PostgreSQL, with several workers.

Simulated workers run the real named queries (``outbox.sql.queries``) with the parameters
in the formats the Dispatcher sends (a ``text[]`` literal of effect names for the claim,
one JSON array of claims for heartbeat, complete and settle), in any order hypothesis
picks: claim, heartbeat, complete, settle (retry, fail, unknown outcome, release with the
attempt refunded), a lease running out (``lease_until`` moved into the past, and
optionally ``first_attempted_at`` two days back: what time passing does), the rescuer,
and an operator's retry. Each worker remembers what it believes it holds (job id, claim
version, attempt); it never forgets a claim until it has written its outcome, so stale
writes are tried often.

After every step, read back from the database: status is one of the five; lease and owner
are set if and only if running; claim_version never goes down and attempts only go up (but
for the refunded release and the operator's reset); at most one worker's claim is valid
for a job, and it is the job's ``claimed_by``; a job is done if and only if it has exactly
one ledger row, written at its current claim version; never more attempts than
max_attempts; and every row agrees with the model. Within each step, a write with a stale
claim changes no row (rowcount 0, row byte-for-byte unchanged).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import psycopg
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from psycopg import sql
from psycopg.rows import namedtuple_row

import outbox
from outbox import Permanent, Retry, UnknownOutcome, _queue
from outbox._lifecycle import Backoff, Rules, settle
from outbox._lifecycle import expired as expired_decision
from outbox.dispatcher import _text_array
from outbox.sql import queries

WORKERS = ("worker-a", "worker-b", "worker-c")
EFFECTS = ("test.mail", "test.charge")
UNKNOWN_EFFECT = "test.nobody"
CLAIMED_EFFECTS = _text_array(sorted(EFFECTS))  # the claim's effects parameter, as sent
LEASE = 30.0
WINDOW = 86400.0  # the dispatcher's default unknown_outcome_window
STATUSES = {"pending", "running", "done", "failed", "reconcile"}


class Release(Exception):
    """Stands for the dispatcher handing back an unstarted job (attempt refunded)."""


OUTCOMES: list[BaseException] = [
    Retry("again", after=0),
    Retry("later", after=3600),
    RuntimeError("boom"),
    Permanent("never"),
    UnknownOutcome("maybe", after=0),
    Release(),
]


class Highest(random.Random):
    """The jitter at its top: a backoff's delay is its bound (an hour and more here), so a
    job rescued to pending stays not due for the whole run."""

    def uniform(self, a: float, b: float) -> float:
        return b


HIGHEST = Highest(0)


@dataclass
class ModelJob:
    """What the database should hold for one job."""

    id: int
    key: str
    effect: str
    ordering_key: str | None
    max_attempts: int
    status: str = "pending"
    attempts: int = 0
    version: int = 0
    owner: str | None = None
    due: bool = True
    expired: bool = False
    long_ago: bool = False
    result: Any = None


@dataclass(frozen=True)
class Claim:
    """What a worker believes it holds: a job at a claim version."""

    job_id: int
    version: int
    attempt: int
    first_attempted_at: datetime


Row = dict[str, Any]


class Lifecycle(RuleBasedStateMachine):
    def __init__(self, conn: psycopg.Connection[Any], schema: str) -> None:
        super().__init__()
        self.conn = conn
        self.schema = schema
        self.q = queries(schema)
        self.jobs_table = sql.SQL("{}.jobs").format(sql.Identifier(schema))
        self.ledger_table = sql.SQL("{}.effect_results").format(sql.Identifier(schema))
        conn.execute(sql.SQL("TRUNCATE {}, {} RESTART IDENTITY").format(
            self.jobs_table, self.ledger_table))
        self.model: dict[int, ModelJob] = {}
        self.held: dict[str, list[Claim]] = {w: [] for w in WORKERS}
        self.seen: dict[int, Row] = {}
        self.attempts_may_drop_to: dict[int, int] = {}

    # -- reading the database --------------------------------------------------------

    def rows(self) -> dict[int, Row]:
        cur = self.conn.execute(sql.SQL(
            "SELECT *, available_at <= now() AS due, lease_until > now() AS lease_alive "
            "FROM {} ORDER BY id").format(self.jobs_table))
        names = [d.name for d in cur.description or []]
        return {row[0]: dict(zip(names, row, strict=True)) for row in cur}

    def ledger(self) -> dict[str, Row]:
        cur = self.conn.execute(sql.SQL("SELECT * FROM {}").format(self.ledger_table))
        names = [d.name for d in cur.description or []]
        return {row[0]: dict(zip(names, row, strict=True)) for row in cur}

    def valid(self, claim: Claim) -> bool:
        job = self.model[claim.job_id]
        return job.status == "running" and job.version == claim.version

    def claimable(self, job: ModelJob) -> bool:
        if job.status != "pending" or not job.due or job.effect not in EFFECTS:
            return False
        if job.ordering_key is None:
            return True
        return not any(
            other.ordering_key == job.ordering_key and other.id != job.id
            and (other.status == "running" or (other.status == "pending" and other.id < job.id))
            for other in self.model.values()
        )

    def assert_untouched(self, before: dict[int, Row], after: dict[int, Row],
                         changed: set[int]) -> None:
        for job_id, row in before.items():
            if job_id not in changed:
                assert after[job_id] == row, f"job {job_id} changed by a write not about it"

    def pick_claims(self, data: st.DataObject) -> tuple[str, list[Claim]]:
        worker = data.draw(st.sampled_from([w for w in WORKERS if self.held[w]]), label="worker")
        claims = data.draw(st.lists(st.sampled_from(self.held[worker]), min_size=1, max_size=3,
                                    unique=True), label="claims")
        return worker, claims

    def forget(self, worker: str, claims: list[Claim]) -> None:
        """The worker has written these outcomes (landed or not): it holds them no more."""
        self.held[worker] = [c for c in self.held[worker] if c not in claims]

    def write(self, query: str, params: dict[str, Any], claims: list[Claim]) -> set[int]:
        """Run a fenced write; check exactly the valid claims landed and nothing else moved."""
        expected = {c.job_id for c in claims if self.valid(c)}
        before = self.rows()
        cur = self.conn.execute(query, params)
        landed = {row[0] for row in cur.fetchall()}
        assert landed == expected, (landed, expected)
        assert cur.rowcount == len(expected)
        self.assert_untouched(before, self.rows(), expected)
        return expected

    # -- setting up --------------------------------------------------------------------

    @initialize(specs=st.lists(
        st.tuples(st.sampled_from(EFFECTS), st.integers(1, 3), st.sampled_from([None, "order-7"])),
        min_size=2, max_size=5))
    def enqueue(self, specs: list[tuple[str, int, str | None]]) -> None:
        with outbox.transaction(self.conn, schema=self.schema) as tx:
            for n, (effect, max_attempts, ordering_key) in enumerate(specs):
                self._enqueue(tx, effect, f"job-{n}", max_attempts, ordering_key)
            self._enqueue(tx, UNKNOWN_EFFECT, "job-unknown", 3, None)

    def _enqueue(self, tx: outbox.Transaction, effect: str, key: str, max_attempts: int,
                 ordering_key: str | None) -> None:
        result = tx.enqueue(effect, key=key, payload={"key": key}, ordering_key=ordering_key,
                            max_attempts=max_attempts)
        assert result.created and result.job_id is not None
        self.model[result.job_id] = ModelJob(result.job_id, key, effect, ordering_key,
                                             max_attempts)

    # -- the workers -------------------------------------------------------------------

    @rule(worker=st.sampled_from(WORKERS), limit=st.integers(1, 3), rescue_first=st.booleans())
    def claim(self, worker: str, limit: int, rescue_first: bool) -> None:
        """A claim, after a rescue round when ``rescue_first`` (as the claimer loop does)."""
        if rescue_first:
            self.rescue_expired(1000)
        self.claim_due(worker, limit)

    def claim_due(self, worker: str, limit: int) -> set[int]:
        claimable = {j.id for j in self.model.values() if self.claimable(j)}
        before = self.rows()
        rows = self.conn.execute(self.q.claim, {
            "effects": CLAIMED_EFFECTS, "limit": limit, "lease": LEASE, "worker": worker,
            "after": "{}",
        }).fetchall()
        assert len(rows) == min(limit, len(claimable)), (rows, claimable)
        for job_id, effect, key, payload, attempt, version, ordering_key, max_attempts, \
                first_attempted_at, _waited, _trace_context, _kept, _group, _priority, _slot, \
                _after_failed in rows:
            job = self.model[job_id]
            assert job_id in claimable
            # The claim returns the payload as text (the dispatcher decodes it).
            assert (effect, key, json.loads(payload), ordering_key, max_attempts) == (
                job.effect, job.key, {"key": job.key}, job.ordering_key, job.max_attempts)
            assert (attempt, version) == (job.attempts + 1, job.version + 1)
            job.status, job.attempts, job.version, job.owner = "running", attempt, version, worker
            job.expired = False
            self.held[worker].append(Claim(job_id, version, attempt, first_attempted_at))
        claimed = {row[0] for row in rows}
        self.assert_untouched(before, self.rows(), claimed)
        return claimed

    @precondition(lambda self: any(self.valid(c) for cs in self.held.values() for c in cs))
    @rule(data=st.data(), taker=st.sampled_from(WORKERS))
    def worker_stalls_past_its_lease(self, data: st.DataObject, taker: str) -> None:
        """DESIGN's stall window: a worker stops heartbeating (GC pause, frozen VM) while it
        holds a claim; its lease runs out, the rescuer takes the job back and a claim
        (maybe the same worker's) takes it again. The stalled worker still believes it
        holds the job: whatever it writes next is stale."""
        valid = [(w, c) for w in WORKERS for c in self.held[w] if self.valid(c)]
        _, claim = data.draw(st.sampled_from(valid), label="stalled")
        self.expire([claim.job_id], long_ago=False)
        self.rescue_expired(1000)
        self.claim_due(taker, 3)

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data())
    def heartbeat(self, data: st.DataObject) -> None:
        _, claims = self.pick_claims(data)
        batch = ",".join(f'{{"id":{c.job_id},"version":{c.version}}}' for c in claims)
        before = self.rows()
        alive = self.write(self.q.heartbeat, {"claims": f"[{batch}]", "lease": LEASE}, claims)
        after = self.rows()
        for job_id in alive:
            assert after[job_id]["lease_until"] > before[job_id]["lease_until"]
            self.model[job_id].expired = False

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data(), result=st.none() | st.dictionaries(
        st.sampled_from(["id", "status"]), st.text("ab é-", max_size=5) | st.integers(),
        max_size=2))
    def complete(self, data: st.DataObject, result: dict[str, Any] | None) -> None:
        worker, claims = self.pick_claims(data)
        result_json = json.dumps(result, separators=(",", ":"))
        batch = ",".join(f'{{"id":{c.job_id},"version":{c.version},"result":{result_json}}}'
                         for c in claims)
        done = self.write(self.q.complete, {"claims": f"[{batch}]"}, claims)
        for job_id in done:
            job = self.model[job_id]
            job.status, job.owner, job.result = "done", None, result
        self.forget(worker, claims)

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data(), outcome=st.sampled_from(OUTCOMES))
    def settle(self, data: st.DataObject, outcome: BaseException) -> None:
        worker, claims = self.pick_claims(data)
        refund = isinstance(outcome, Release)
        decisions = {c: self._decision(c, outcome) for c in claims}
        params = json.dumps([
            {"id": c.job_id, "version": c.version, "status": status, "delay": delay,
             "error": error, "refund": refund}
            for c, (status, delay, error) in decisions.items()
        ])
        landing = [c for c in claims if self.valid(c)]  # the stale ones change nothing
        self.write(self.q.settle, {"claims": params}, claims)
        for claim in landing:
            status, delay, _ = decisions[claim]
            job = self.model[claim.job_id]
            job.status, job.owner, job.due = status, None, delay == 0
            if refund:
                job.attempts -= 1
                self.attempts_may_drop_to[job.id] = job.attempts
        self.forget(worker, claims)

    def _decision(self, claim: Claim, outcome: BaseException) -> tuple[str, float, str | None]:
        """What the dispatcher would write for this outcome (its own pure decision)."""
        if isinstance(outcome, Release):
            return "pending", 0.0, None
        job = self.model[claim.job_id]
        attempted = outbox.Job(id=claim.job_id, effect="e", key="k", payload={},
                               attempt=claim.attempt, claim_version=1,
                               max_attempts=job.max_attempts,
                               first_attempted_at=claim.first_attempted_at)
        decision = settle(outcome, attempted, Rules(window=WINDOW,
                                                    backoff=Backoff(base=0.0, cap=0.0)),
                          now=datetime.now(UTC), rng=random.Random(0))
        return decision.status, decision.delay, decision.error

    # -- time passing, the rescuer, the operator --------------------------------------

    @precondition(lambda self: any(j.status == "running" for j in self.model.values()))
    @rule(data=st.data(), everyone=st.booleans(), long_ago=st.booleans())
    def lease_runs_out(self, data: st.DataObject, everyone: bool, long_ago: bool) -> None:
        """Time passes: one running job's lease (or every one's) runs out; with
        ``long_ago``, so does the provider's idempotency window."""
        running = sorted(j.id for j in self.model.values() if j.status == "running")
        chosen = running if everyone else [data.draw(st.sampled_from(running), label="job")]
        self.expire(chosen, long_ago=long_ago)

    def expire(self, job_ids: list[int], *, long_ago: bool) -> None:
        # A lease of its own per job (older for a higher id): the rescue takes the
        # oldest leases first, and among equal ones its pick would be the database's, so
        # the same steps could lead hypothesis down different paths (a flaky example).
        statement = (
            "UPDATE {} SET lease_until = now() - interval '1 second'"
            " - id * interval '1 millisecond'"
            + (", first_attempted_at = now() - interval '2 days'" if long_ago else "")
            + " WHERE id = ANY(%s)"
        )
        self.conn.execute(sql.SQL(statement).format(self.jobs_table), (job_ids,))
        for job_id in job_ids:
            self.model[job_id].expired = True
            self.model[job_id].long_ago |= long_ago

    @precondition(lambda self: any(j.status == "running" for j in self.model.values()))
    @rule(limit=st.sampled_from([1, 2, 1000]))
    def rescue(self, limit: int) -> None:
        self.rescue_expired(limit)

    def rescue_expired(self, limit: int) -> None:
        """The rescuer as the dispatcher runs it: read the expired claims, decide each
        with ``_lifecycle.expired`` (an unknown outcome, with the backoff), apply the
        decisions with ``settle``, fenced on the lease."""
        expired = {j.id for j in self.model.values() if j.status == "running" and j.expired}
        before = self.rows()
        with self.conn.cursor(row_factory=namedtuple_row) as cur:
            read: list[Any] = cur.execute(self.q.rescue, {"limit": limit}).fetchall()
        assert len(read) == min(limit, len(expired)), (read, expired)
        decisions = {}
        for row in read:
            facts = outbox.Job(id=row.id, effect=row.effect, key=row.key, payload={},
                               attempt=row.attempts, claim_version=row.claim_version,
                               max_attempts=row.max_attempts,
                               first_attempted_at=row.first_attempted_at)
            decisions[row.id] = expired_decision(
                facts, Rules(window=WINDOW, backoff=Backoff(base=3600.0, cap=86400.0)),
                now=row.now, rng=HIGHEST, worker=row.claimed_by, cancelled=row.cancelled)
        claims = json.dumps([{"id": r.id, "version": r.claim_version,
                              "status": decisions[r.id].status, "delay": decisions[r.id].delay,
                              "error": decisions[r.id].error, "refund": False,
                              "expired": True} for r in read])
        applied = {row[0] for row in self.conn.execute(self.q.settle, {"claims": claims})}
        assert applied == {r.id for r in read}, "nothing renewed them between read and apply"
        after = self.rows()
        for row in read:
            job, decision = self.model[row.id], decisions[row.id]
            assert row.id in expired and (row.key, row.claim_version) == (job.key, job.version)
            # An expired lease is an unknown outcome: the attempts used up or the window
            # past send it to reconcile (the provider may have acted), never to failed.
            expected = ("reconcile" if job.long_ago or job.attempts >= job.max_attempts
                        else "pending")
            assert after[row.id]["status"] == decision.status == expected
            assert after[row.id]["last_error"].startswith(
                f"UnknownOutcome: lease expired on attempt {job.attempts} of "
                f"{job.max_attempts} (worker {job.owner} stopped heartbeating)")
            if expected == "pending":  # the backoff, as after a perform's retry
                assert decision.delay >= 3600.0 and not after[row.id]["due"]
            job.status, job.owner, job.expired = expected, None, False
            job.due = expected != "pending"
        self.assert_untouched(before, after, applied)

    @precondition(lambda self: any(j.status in ("failed", "reconcile")
                                   for j in self.model.values()))
    @rule(data=st.data())
    def operator_retry(self, data: st.DataObject) -> None:
        job_id = data.draw(st.sampled_from(sorted(self.model)), label="job")
        job = self.model[job_id]
        before = self.rows()
        done = _queue.on(self.conn, _queue.retry(
            self.schema, job_id, _queue.Operator("property test", "command line")))
        if job.status in ("failed", "reconcile"):
            assert (done.changed, done.status, done.key, done.effect) == (
                True, "pending", job.key, job.effect)
            job.status, job.attempts, job.due, job.long_ago = "pending", 0, True, False
            self.attempts_may_drop_to[job_id] = 0
            self.assert_untouched(before, self.rows(), {job_id})
        else:
            assert (done.changed, done.status) == (False, job.status)
            self.assert_untouched(before, self.rows(), set())

    # -- invariants --------------------------------------------------------------------

    @invariant()
    def database_agrees_with_the_rules(self) -> None:
        rows, ledger = self.rows(), self.ledger()
        assert set(rows) == set(self.model)
        for job_id, row in rows.items():
            self._check_row(row, self.model[job_id], ledger.get(row["key"]))
            self._check_monotonic(row, self.seen.get(job_id))
            self._check_single_owner(row)
        keys = {row["key"] for row in rows.values() if row["status"] == "done"}
        assert set(ledger) == keys, "a ledger row without its done job, or the reverse"
        self.seen = rows
        self.attempts_may_drop_to = {}

    def _check_row(self, row: Row, job: ModelJob, entry: Row | None) -> None:
        assert row["status"] in STATUSES
        running = row["status"] == "running"
        assert (row["lease_until"] is not None) == running
        assert (row["claimed_by"] is not None) == running
        assert (row["status"], row["attempts"], row["claim_version"], row["claimed_by"]) == (
            job.status, job.attempts, job.version, job.owner)
        assert row["attempts"] <= row["max_attempts"]
        if row["status"] == "pending":
            assert row["attempts"] < row["max_attempts"]
            assert row["due"] == job.due
        if running:
            assert row["lease_alive"] == (not job.expired)
        if job.effect == UNKNOWN_EFFECT:
            assert (row["status"], row["attempts"], row["claim_version"]) == ("pending", 0, 0)
        if row["status"] == "done":
            assert entry is not None, f"done job {job.key} without its ledger row"
            assert (entry["job_id"], entry["claim_version"], entry["effect"]) == (
                job.id, row["claim_version"], job.effect)
            assert entry["result"] == job.result
        else:
            assert entry is None, f"ledger row for {job.key}, which is {row['status']}"

    def _check_monotonic(self, row: Row, previous: Row | None) -> None:
        if previous is None:
            return
        assert row["claim_version"] >= previous["claim_version"]
        drop = self.attempts_may_drop_to.get(row["id"])
        assert row["attempts"] >= previous["attempts"] or row["attempts"] == drop

    def _check_single_owner(self, row: Row) -> None:
        owners = [w for w, claims in self.held.items() for c in claims
                  if c.job_id == row["id"] and c.version == row["claim_version"]
                  and row["status"] == "running"]
        assert len(owners) <= 1, f"job {row['id']} validly held by {owners}"
        if owners:
            assert row["claimed_by"] == owners[0]


# No shrinking: against a database it takes minutes, past the per-test timeout. A failure
# is reported at once as the whole sequence of steps, each named with its arguments.
SETTINGS = settings(
    max_examples=60, stateful_step_count=40, deadline=None, database=None,
    phases=[Phase.explicit, Phase.generate], suppress_health_check=[HealthCheck.too_slow],
)


def test_job_lifecycle(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:

        class OnThisSchema(Lifecycle):
            def __init__(self) -> None:
                super().__init__(conn, schema)

        run_state_machine_as_test(OnThisSchema, settings=SETTINGS)
