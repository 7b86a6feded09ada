"""Plan tests: every hot or periodic statement, on tables of a realistic size, reads
neither the jobs table nor the ledger sequentially, and reads a bounded number of their
rows (what it needs, whatever the backlog and the history).

One data set for the module (built once with generate_series, then VACUUM ANALYZEd, as
autovacuum leaves a live table): 150,000 done jobs and 250,000 ledger rows of history,
90,000 due jobs of three effects over 2,000 groups, running jobs (some past their
lease), failed and reconcile jobs, jobs behind ordering keys and jobs waiting on their
parents. Each statement runs under EXPLAIN (ANALYZE, FORMAT JSON) in a transaction that
is rolled back, so the data set is the same for every test.

"Rows read" of a table is, over every plan node on it, the rows the node returned plus
those its filter removed, times its loops: what the statement made PostgreSQL look at.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import cache
from importlib import resources
from typing import Any

import psycopg
import pytest
from psycopg import sql

from outbox.sql import bind_blocks, core_fragments, parse_sql, queries
from outbox.testing import create_schema, drop_schema

DONE = 150_000
PENDING = 90_000
GROUPS = 2_000
RUNNING = 600
EXPIRED = 200  # of the running jobs, past their lease
FAILED = 5_000
RECONCILE = 100
ORDERED = 300  # pending jobs behind 30 ordering keys
WAITING = 200  # pending jobs waiting on a parent (after=[...])
PURGED = 100_000  # ledger rows whose jobs retention already deleted
LEDGER = DONE + PURGED
EFFECTS = ("plan.e0", "plan.e1", "plan.e2")
TABLES = ("jobs", "effect_results")
CAP = 10_000  # the readings' cap (the queue model passes its own)
GROUP_CAP = 2_000
SAMPLE_PAGES = 200  # pages a block sample reads


@cache
def blocks(package: str, path: str, schema: str) -> dict[str, str]:
    """The named statements of ``path`` (in ``package``) bound to ``schema``."""
    own = parse_sql(resources.files(package).joinpath(path).read_text("utf-8"))
    return bind_blocks(own.blocks, schema, {**core_fragments(), **own.fragments})


def queue(schema: str) -> dict[str, str]:
    """The queue model's readings (outbox status, the dashboard, the scrape)."""
    return blocks("outbox", "sql/queue.sql", schema)


def web(schema: str) -> dict[str, str]:
    """The dashboard's readings."""
    return blocks("outbox.web", "queries.sql", schema)


def pages(dsn: str, schema: str) -> int:
    with psycopg.connect(dsn) as conn:
        [(found,)] = conn.execute("SELECT pg_relation_size(%s::regclass) / 8192",
                                  (f'"{schema}".jobs',)).fetchall()
    return int(found)


@dataclass(frozen=True)
class Plan:
    """One statement's plan, as EXPLAIN (ANALYZE) ran it."""

    root: dict[str, Any]

    def nodes(self) -> Iterator[dict[str, Any]]:
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.get("Plans", []))

    def sequential(self) -> list[str]:
        """The tables of ours read by a sequential scan."""
        return [n["Relation Name"] for n in self.nodes()
                if n["Node Type"] == "Seq Scan" and n.get("Relation Name") in TABLES]

    def rows_read(self, table: str) -> float:
        return sum(float((n.get("Actual Rows", 0) + n.get("Rows Removed by Filter", 0)
                    + n.get("Rows Removed by Index Recheck", 0)) * n.get("Actual Loops", 1))
                   for n in self.nodes() if n.get("Relation Name") == table)

    def check(self, *, jobs: float, ledger: float = 0) -> None:
        """No sequential scan of jobs or the ledger, and at most ``jobs`` and ``ledger``
        rows read of each."""
        assert self.sequential() == [], self.describe()
        assert self.rows_read("jobs") <= jobs, self.describe()
        assert self.rows_read("effect_results") <= ledger, self.describe()

    def describe(self) -> str:
        return "\n".join(
            f"{n['Node Type']} {n.get('Relation Name', '')} {n.get('Index Name', '')} "
            f"rows={n.get('Actual Rows')} removed={n.get('Rows Removed by Filter', 0)} "
            f"loops={n.get('Actual Loops')}" for n in self.nodes())


@pytest.fixture(scope="module")
def big(dsn: str) -> Iterator[str]:
    """A schema holding the module's data set."""
    schema = create_schema(dsn)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            with conn.transaction():
                _fill(conn, schema)
            for table in ("jobs", "effect_results", "after_edges"):
                conn.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(schema, table)))
        yield schema
    finally:
        drop_schema(dsn, schema)


def _fill(conn: psycopg.Connection[Any], schema: str) -> None:
    names = {"jobs": sql.Identifier(schema, "jobs"),
             "ledger": sql.Identifier(schema, "effect_results"),
             "edges": sql.Identifier(schema, "after_edges"),
             "dispatchers": sql.Identifier(schema, "dispatchers"),
             "limits": sql.Identifier(schema, "effect_limits")}

    def run(statement: str, **params: Any) -> None:
        conn.execute(sql.SQL(statement).format(**names), params)

    columns = ("effect, key, payload, fingerprint, status, attempts, claim_version, "
               "available_at, lease_until, claimed_by, ordering_key, last_error, "
               "first_attempted_at, created_at, updated_at, group_key, after_waiting, "
               "after_failed")
    # history first (the oldest rows of the table), two to nine days old
    run(f"""INSERT INTO {{jobs}} ({columns})
        SELECT 'plan.e' || n %% 3, 'done-' || n, '{{{{}}}}', 'f', 'done', 1, 1,
               now() - interval '9 days', NULL, NULL, NULL, NULL,
               now() - interval '9 days', now() - interval '9 days',
               now() - interval '2 days' - n * interval '4 seconds',
               'g' || n %% %(groups)s, 0, NULL
        FROM generate_series(1, %(n)s) AS n""", n=DONE, groups=GROUPS)
    run("""INSERT INTO {ledger} (key, effect, job_id, claim_version, result, fingerprint,
                                  recorded_at)
        SELECT j.key, j.effect, j.id, j.claim_version, NULL, 'f', j.updated_at
        FROM {jobs} j WHERE j.status = 'done'""")
    run("""INSERT INTO {ledger} (key, effect, job_id, claim_version, result, fingerprint,
                                  recorded_at)
        SELECT 'gone-' || n, 'plan.e' || n %% 3, -n, 1, NULL, 'f',
               now() - interval '100 days' + n * interval '1 second'
        FROM generate_series(1, %(n)s) AS n""", n=PURGED)
    run(f"""INSERT INTO {{jobs}} ({columns})
        SELECT 'plan.e' || n %% 3, 'failed-' || n, '{{{{}}}}', 'f', 'failed', 25, 25,
               now() - interval '1 day', NULL, NULL, NULL,
               'ProviderError: 500 for request req_' || n, now() - interval '1 day',
               now() - interval '1 day', now() - interval '1 hour' + n * interval '1 second',
               'g' || n %% %(groups)s, 0, NULL
        FROM generate_series(1, %(n)s) AS n""", n=FAILED, groups=GROUPS)
    # the backlog: due since the last hour, over 2,000 groups, 3 effects
    run(f"""INSERT INTO {{jobs}} ({columns})
        SELECT 'plan.e' || n %% 3, 'due-' || n, '{{{{}}}}', 'f', 'pending', 0, 0,
               now() - interval '1 hour' + n * interval '10 milliseconds', NULL, NULL, NULL,
               NULL, NULL, now() - interval '1 hour', now() - interval '1 hour',
               'g' || n %% %(groups)s, 0, NULL
        FROM generate_series(1, %(n)s) AS n""", n=PENDING, groups=GROUPS)
    run(f"""INSERT INTO {{jobs}} ({columns})
        SELECT 'plan.e0', 'ordered-' || n, '{{{{}}}}', 'f', 'pending', 0, 0,
               now() - interval '30 minutes', NULL, NULL, 'line-' || n %% 30, NULL, NULL,
               now() - interval '30 minutes', now() - interval '30 minutes', NULL, 0, NULL
        FROM generate_series(1, %(n)s) AS n""", n=ORDERED)
    run(f"""INSERT INTO {{jobs}} ({columns})
        SELECT 'plan.e1', 'child-' || n, '{{{{}}}}', 'f', 'pending', 0, 0,
               timestamptz '9999-01-01 00:00:00+00', NULL, NULL, NULL, NULL, NULL,
               now(), now(), NULL, 1, 'fail'
        FROM generate_series(1, %(n)s) AS n""", n=WAITING)
    run("""INSERT INTO {edges} (child_id, parent_key)
        SELECT j.id, 'due-' || (row_number() OVER (ORDER BY j.id))
        FROM {jobs} j WHERE j.key LIKE 'child-%%'""")
    run(f"""INSERT INTO {{jobs}} ({columns})
        SELECT 'plan.e' || n %% 3, 'running-' || n, '{{{{}}}}', 'f', 'running', 1, 1,
               now() - interval '5 minutes',
               CASE WHEN n <= %(expired)s THEN now() - interval '1 minute'
                    ELSE now() + interval '10 minutes' END,
               'worker-' || n %% 8, NULL, NULL, now() - interval '5 minutes',
               now() - interval '5 minutes', now() - interval '5 minutes',
               'g' || n %% %(groups)s, 0, NULL
        FROM generate_series(1, %(n)s) AS n""", n=RUNNING, expired=EXPIRED, groups=GROUPS)
    run(f"""INSERT INTO {{jobs}} ({columns})
        SELECT 'plan.e2', 'reconcile-' || n, '{{{{}}}}', 'f', 'reconcile', 3, 3,
               now() - interval '1 day', NULL, NULL, NULL, 'UnknownOutcome: timed out',
               now() - interval '1 day', now() - interval '1 day',
               now() - interval '6 hours', NULL, 0, NULL
        FROM generate_series(1, %(n)s) AS n""", n=RECONCILE)
    run("""INSERT INTO {dispatchers} (worker_id, effects, expires_at)
        VALUES ('plan', ARRAY['plan.e0', 'plan.e1'], now() + interval '1 day')""")
    run("""INSERT INTO {limits} (effect, tokens, rate, burst, declared_at)
        VALUES ('plan.e0', 10, 10.0, 10.0, now())""")


def explain(dsn: str, query: str, params: Mapping[str, Any],
            before: tuple[str, Mapping[str, Any]] | None = None) -> Plan:
    """``query`` under EXPLAIN (ANALYZE), after ``before`` (a statement and its
    parameters) in the same transaction; everything rolled back."""
    with psycopg.connect(dsn) as conn:
        try:
            if before is not None:
                conn.execute(*before)
            [(found,)] = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + query,
                                      params).fetchall()
        finally:
            conn.rollback()
    return Plan((found if isinstance(found, list) else json.loads(found))[0]["Plan"])


def claims(dsn: str, schema: str, where: str, *, limit: int = 50) -> list[dict[str, Any]]:
    """(id, version, key) of ``limit`` jobs ``where`` (a literal condition on jobs j)."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(sql.SQL("SELECT j.id, j.claim_version, j.key FROM {} j WHERE "
                                    + where + " ORDER BY j.id LIMIT %(limit)s").format(
            sql.Identifier(schema, "jobs")), {"limit": limit}).fetchall()
    assert len(rows) == limit
    return [{"id": job_id, "version": version, "key": key} for job_id, version, key in rows]


def live_claims(dsn: str, schema: str) -> list[dict[str, Any]]:
    return claims(dsn, schema, "j.status = 'running' AND j.lease_until > now()")


# -- the dispatcher's hot statements ----------------------------------------------------


def test_the_claim_takes_its_batch_reading_a_bounded_part_of_the_backlog(
        dsn: str, big: str) -> None:
    plan = explain(dsn, queries(big).claim, {
        "effects": list(EFFECTS), "limit": 100, "lease": 30.0, "worker": "w",
        "after": "{}"})
    # 100 jobs fairly over 2,000 groups: a probe per group walked, not a walk of the
    # 90,000 due jobs
    plan.check(jobs=5_000)


def test_a_limited_claim_reads_a_bounded_part_of_the_backlog(dsn: str, big: str) -> None:
    plan = explain(dsn, queries(big).limit_claim, {
        "effect": "plan.e0", "limit": 100, "lease": 30.0, "worker": "w", "after": "{}",
        "rate": 10.0, "burst": 10.0, "concurrency": None, "group_rate": None,
        "group_burst": None, "group_concurrency": None})
    plan.check(jobs=2_000)


@pytest.mark.parametrize("name", ["complete", "complete_delete"])
def test_done_writes_reads_the_claims_jobs_only(dsn: str, big: str, name: str) -> None:
    done = [{**c, "result": {"ok": True}} for c in live_claims(dsn, big)]
    plan = explain(dsn, getattr(queries(big), name), {"claims": json.dumps(done)})
    # at most the running jobs (the planner may hash the claims against them): as many
    # as the dispatchers hold, never the backlog or the history
    plan.check(jobs=RUNNING + 100, ledger=0)


def test_recorded_claims_reads_the_claims_ledger_rows_only(dsn: str, big: str) -> None:
    # after a lost reply: which of these claims' done landed (the ledger by key, 0023)
    recorded = claims(dsn, big, "j.status = 'done'")
    plan = explain(dsn, queries(big).recorded_claims, {"claims": json.dumps(recorded)})
    plan.check(jobs=0, ledger=200)
    assert plan.root["Actual Rows"] == len(recorded)


def test_settle_and_heartbeat_read_the_claims_jobs_only(dsn: str, big: str) -> None:
    live = live_claims(dsn, big)
    settled = [{**c, "status": "pending", "delay": 5.0, "error": "timeout",
                "refund": False} for c in live]
    # at most the running jobs, as the done writes
    explain(dsn, queries(big).settle, {"claims": json.dumps(settled)}).check(
        jobs=RUNNING + 100)
    explain(dsn, queries(big).heartbeat, {"claims": json.dumps(live), "lease": 30.0}).check(
        jobs=RUNNING + 100)


def test_the_rescue_reads_the_expired_leases_only(dsn: str, big: str) -> None:
    plan = explain(dsn, queries(big).rescue, {"limit": 100, "windows": "{}",
                                              "unknown_window": 3600.0})
    plan.check(jobs=3 * EXPIRED)


def test_the_dispatchers_idle_checks_read_next_to_nothing(dsn: str, big: str) -> None:
    q = queries(big)
    for name in ("has_due_work", "target_due", "target_due_next", "target_due_quiet"):
        explain(dsn, getattr(q, name), {"effects": list(EFFECTS)}).check(jobs=50)
    explain(dsn, q.effect_claimable, {"effect": "plan.e2"}).check(jobs=50)
    explain(dsn, q.lookup_keys, {"keys": ["due-1", "done-1", "gone-1", "new-1"]}).check(
        jobs=10, ledger=10)


@pytest.mark.parametrize(("name", "table", "read"), [
    ("purge_done", "jobs", 3_000), ("purge_ledger", "effect_results", 3_000)])
def test_retention_reads_a_batch_of_the_oldest_rows(
        dsn: str, big: str, name: str, table: str, read: int) -> None:
    plan = explain(dsn, getattr(queries(big), name), {"age": 86_400.0, "limit": 1000})
    assert plan.sequential() == [], plan.describe()
    assert plan.rows_read(table) <= read, plan.describe()


def test_the_maintenance_looks_read_the_statistics_not_the_tables(dsn: str, big: str) -> None:
    q = queries(big)
    tables = ["jobs", "effect_results", "inbox"]
    explain(dsn, q.vacuum_due, {"schema_name": big, "tables": tables, "rows": 1000,
                                "share": 0.1, "gap": 60.0}).check(jobs=0)
    explain(dsn, q.unanalyzed_tables, {"schema_name": big, "tables": tables,
                                       "rows": 1000}).check(jobs=0)


def test_the_limits_readings_read_the_last_minute_of_the_ledger(dsn: str, big: str) -> None:
    q = queries(big)
    explain(dsn, q.limits_overview, {}).check(jobs=0, ledger=100)
    explain(dsn, q.limit_states, {"effects": list(EFFECTS)}).check(jobs=0)


# -- the scrape ---------------------------------------------------------------------------


def test_the_scrapes_counts_stop_at_the_cap(dsn: str, big: str) -> None:
    plan = explain(dsn, queue(big)["counts_capped"], {"cap": CAP})
    # each status up to the cap: pending and done past it, the others all
    plan.check(jobs=2 * (CAP + 1) + RUNNING + FAILED + RECONCILE)


def test_the_scrapes_samples_read_a_share_of_the_pages(dsn: str, big: str) -> None:
    table = pages(dsn, big)
    percent = 100.0 * SAMPLE_PAGES / table
    for name in ("status_sample", "group_sample"):
        plan = explain(dsn, queue(big)[name], {"percent": percent})
        # about SAMPLE_PAGES of the table's pages: their rows, whatever the table holds
        rows_per_page = (DONE + PENDING + FAILED + RUNNING) / table
        plan.check(jobs=3 * SAMPLE_PAGES * rows_per_page)
        assert plan.rows_read("jobs") < (DONE + PENDING) / 4


def test_the_scrapes_health_reads_neither_backlog_nor_history(dsn: str, big: str) -> None:
    plan = explain(dsn, queue(big)["effect_health"], {})
    # the running, reconcile and waiting jobs, a probe per effect, the heads of the
    # ordering keys' lines
    plan.check(jobs=RUNNING + RECONCILE + WAITING + ORDERED + 100)
    plan = explain(dsn, queue(big)["unserved_due"], {"cap": CAP})
    # plan.e2 is served by nobody: its due jobs are counted, up to the cap (and the
    # oldest found); the served effects' are not read
    plan.check(jobs=CAP + 100)


def test_the_due_backlog_per_effect_stops_at_the_cap(dsn: str, big: str) -> None:
    # outbox status and the dashboard's targets: each effect's due jobs up to the cap
    plan = explain(dsn, queue(big)["due_by_effect"], {"cap": CAP})
    plan.check(jobs=len(EFFECTS) * CAP + WAITING + ORDERED + 100)


def test_the_busiest_groups_stop_at_their_cap(dsn: str, big: str) -> None:
    plan = explain(dsn, queue(big)["busiest_groups"], {"cap": GROUP_CAP, "top": 5})
    plan.check(jobs=GROUP_CAP + 1)


def test_the_schedules_gauges_read_no_job(dsn: str, big: str) -> None:
    explain(dsn, blocks("outbox", "sql/schedules.sql", big)["schedule_gauges"],
            {"limit": 200, "grace": 120.0}).check(jobs=0)


# -- the dashboard's lists ----------------------------------------------------------------


def _filter(**given: Any) -> dict[str, Any]:
    return {"status": None, "effect": None, "key_prefix": None, "older_than": None,
            "newer_than": None, "error": None, **given}


@pytest.mark.parametrize("given", [{}, {"status": "pending"}, {"status": "running"},
                                   {"effect": "plan.e1"}],
                         ids=["all", "pending", "running", "effect"])
def test_a_page_of_the_job_list_reads_about_a_page(
        dsn: str, big: str, given: dict[str, Any]) -> None:
    plan = explain(dsn, web(big)["job_page"], {**_filter(**given), "before": None,
                                                    "limit": 51})
    plan.check(jobs=2_000)


@pytest.mark.parametrize("status", ["failed", "done", "reconcile"])
def test_a_page_of_finished_jobs_reads_a_page_past_any_backlog(
        dsn: str, big: str, status: str) -> None:
    # in id order, 90,000 newer pending jobs stand before the failed ones (job_page
    # walked them all, 91,251 rows for 51); in jobs_finished a page is a page
    query = web(big)["job_page_finished"]
    first = explain(dsn, query, {**_filter(status=status), "before": None,
                                 "before_at": None, "limit": 51})
    first.check(jobs=200)
    with psycopg.connect(dsn) as conn:
        page = conn.execute(query, {**_filter(status=status), "before": None,
                                    "before_at": None, "limit": 51}).fetchall()
    last = page[-1]  # id, ..., updated_at is the 10th column
    following = explain(dsn, query, {**_filter(status=status), "before": last[0],
                                     "before_at": last[9], "limit": 51})
    following.check(jobs=200)


def test_the_job_lists_count_stops_at_its_cap(dsn: str, big: str) -> None:
    plan = explain(dsn, web(big)["job_count"], {**_filter(), "cap": 10_001})
    plan.check(jobs=10_001)


def test_the_filter_menus_effects_read_neither_backlog_nor_ledger(dsn: str, big: str) -> None:
    plan = explain(dsn, web(big)["effects_seen"], {"schema_name": big})
    plan.check(jobs=RUNNING + 2_000 + 100, ledger=0)
    with psycopg.connect(dsn) as conn:
        effects = [r[0] for r in conn.execute(web(big)["effects_seen"],
                                              {"schema_name": big})]
    assert effects == list(EFFECTS)


def test_the_overviews_other_readings_are_bounded(dsn: str, big: str) -> None:
    w, q = web(big), queries(big)
    explain(dsn, w["dispatchers"], {}).check(jobs=RUNNING)
    # the last hour's settled jobs: here the failures of the last hour
    explain(dsn, w["settled_per_minute"], {"since": datetime.now(UTC) - timedelta(minutes=59)}
            ).check(jobs=FAILED)
    explain(dsn, q.failed_groups, {"limit": 20}).check(jobs=FAILED)
    explain(dsn, w["recent_audit"], {"limit": 10}).check(jobs=0)


# -- the other parts' periodic statements, and the business's inserts ------------------------


def flows(schema: str) -> dict[str, str]:
    """The reconciler's and the flows' statements."""
    return blocks("outbox", "sql/flows.sql", schema)


def after(schema: str) -> dict[str, str]:
    """Fan-in's statements."""
    return blocks("outbox", "sql/after.sql", schema)


def test_the_presence_check_reads_the_two_ends_of_the_due_backlog_only(
        dsn: str, big: str) -> None:
    # outbox/_dispatch/presence.py: every dispatcher, every presence interval
    limit = 1_000
    plan = explain(dsn, queries(big).unhandled_due, {"limit": limit})
    plan.check(jobs=2 * limit + 50)


def test_the_fan_in_sweep_reads_a_batch_of_edges_and_their_parents(dsn: str, big: str) -> None:
    # outbox/_after.py: every dispatcher, every sweep interval, from the first edge
    plan = explain(dsn, after(big)["after_sweep"], {"child": 0, "parent": "", "limit": 100})
    plan.check(jobs=100 * 4)


def test_the_reconcilers_take_reads_the_jobs_in_reconcile_only(dsn: str, big: str) -> None:
    # outbox/_dispatch/reconciler.py: every reconcile interval
    plan = explain(dsn, flows(big)["reconcile_take"],
                   {"effects": list(EFFECTS), "limit": 50, "hold": 60.0})
    plan.check(jobs=3 * RECONCILE)


def test_an_enqueue_reads_no_job_but_its_key(dsn: str, big: str) -> None:
    # the business's transaction: one job, and a batch of a hundred
    q = queries(big)
    one = {"effect": "plan.e0", "key": "new-1", "payload": "{}", "fingerprint": "f",
           "run_at": None, "ordering_key": None, "max_attempts": 25, "trace_context": None,
           "group_key": "g1", "priority": 0, "channel": "outbox_plan"}
    explain(dsn, q.enqueue, one).check(jobs=5, ledger=5)
    batch = json.dumps([{"effect": "plan.e1", "key": f"new-{n}", "payload": {},
                         "fingerprint": "f", "run_at": None, "ordering_key": None,
                         "max_attempts": 25, "group_key": None, "priority": 0}
                        for n in range(100)])
    explain(dsn, q.enqueue_many, {"jobs": batch, "channel": "outbox_plan",
                                  "trace_context": None}).check(jobs=100 * 3, ledger=100 * 3)

