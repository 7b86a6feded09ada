"""Limits per group across real dispatcher processes: each group's concurrency and rate
are counted in PostgreSQL and shared by every process, as an effect's are."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

import psycopg

import outbox
from effects.testing import FakeEmailProvider

from .support import EMAIL, finish, max_overlap, rows, start_workers, status_counts
from .worker import TRACE_EFFECT, create_trace_table


def enqueue_groups(dsn: str, schema: str, effect: str, groups: Sequence[str], per_group: int,
                   payload: dict[str, object] | None = None) -> None:
    """``per_group`` jobs of ``effect`` in each group, keyed ``<group>.<n>``."""
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue_many([outbox.NewJob(effect, f"{g}.{n}", payload or {}, group=g)
                         for n in range(per_group) for g in groups])


def by_group(traced: list[tuple[datetime, datetime, str]]) -> dict[str, list[tuple[datetime,
                                                                               datetime]]]:
    found: dict[str, list[tuple[datetime, datetime]]] = {}
    for started, ended, key in traced:
        found.setdefault(key.split(".")[0], []).append((started, ended))
    return found


def test_a_concurrency_per_group_is_counted_across_processes(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_trace_table(conn, schema)
    enqueue_groups(dsn, schema, TRACE_EFFECT, ["a", "b", "c"], per_group=6)
    # One perform at a time per process, none claimed ahead: groups running side by side
    # are different processes' (a process with room for three could take every group's
    # one slot and keep them, each finished job re-claimed before another process looks),
    # and only a count shared by the three processes keeps each group to one at a time.
    workers = start_workers(3, dsn, schema, "--effect", "trace", "--seconds", "0.2",
                            "--concurrency", "1", "--prefetch", "0",
                            "--limit", "concurrency=1,per_group", "--together", "3")
    finish(workers)
    assert status_counts(dsn, schema) == {"done": 18}
    traced = rows(dsn, "SELECT started, ended, key FROM {schema}.limit_trace", schema)
    assert len(traced) == 18
    for group, intervals in by_group(traced).items():
        assert max_overlap(intervals) == 1, group
    assert max_overlap([(s, e) for s, e, _ in traced]) >= 2, "the groups never overlapped"
    pids = {r[0] for r in rows(dsn, "SELECT DISTINCT pid FROM {schema}.limit_trace", schema)}
    assert len(pids) >= 2, "the count was not shared: one process did all the work"


def test_three_processes_keep_each_tenant_within_its_accounts_rate(dsn: str,
                                                                    schema: str) -> None:
    # Three tenants, each sending from its own domain, against a provider admitting
    # 5/s per sending domain; three dispatcher processes with Limit(rate=5, per_group).
    groups = ["acme", "beta", "cafe"]
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_trace_table(conn, schema)  # and the workers' start barrier
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue_many([outbox.NewJob("email.send", f"{g}.{n}", {**EMAIL,
                                       "from": f"Shop <shop@{g}.example>"}, group=g)
                         for n in range(15) for g in groups])
    with FakeEmailProvider(rate_limit_per_domain=5.0) as fake:
        workers = start_workers(3, dsn, schema, "--effect", "email", "--url", fake.url,
                                "--limit", "5/s,per_group", "--together", "3")
        finish(workers)
        requests, throttled = fake.requests_by_domain(), fake.throttled_by_domain()
    assert status_counts(dsn, schema) == {"done": 45}
    assert set(requests) == {f"{g}.example" for g in groups}
    # Every send within its domain's rate but for the odd claim whose request reached the
    # provider later than its neighbour's: at most 5 % refused, and none failed.
    assert sum(throttled.values()) <= 0.05 * sum(requests.values()), (throttled, requests)
