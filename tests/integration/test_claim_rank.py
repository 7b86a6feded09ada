"""claim_rank as migration 0020 leaves it: inlined by the planner, and the same value as
0010's body to the bit, so the entries jobs_fair already holds stay true."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from outbox.migrate import migrate

# 0010's body, the definition every entry of jobs_fair made before 0020 was computed with.
BEFORE = "date_part('epoch', t) - p * 10.0"
ZONES = ("UTC", "America/New_York", "Asia/Kolkata", "Pacific/Chatham")


@pytest.fixture
def at_19(dsn: str) -> Iterator[str]:
    """A schema migrated up to 0019 only."""
    name = f"r_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(conn, name, target=19)
    yield name
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


def test_claim_rank_is_inlined(dsn: str, schema: str) -> None:
    # Not inlined, the function shows by name in the plan (each row a call to the
    # SQL-function executor); inlined, its body does.
    with psycopg.connect(dsn, autocommit=True) as conn:
        plan = "\n".join(str(row[0]) for row in conn.execute(sql.SQL(
            "EXPLAIN (VERBOSE) SELECT {}.claim_rank(j.available_at, j.priority) FROM {}.jobs j"
        ).format(sql.Identifier(schema), sql.Identifier(schema))))
    assert "claim_rank" not in plan, plan
    assert "date_part" in plan, plan


def test_claim_rank_keeps_0010s_values_in_every_time_zone(dsn: str, schema: str) -> None:
    query = sql.SQL(
        "SELECT count(*), count(*) FILTER (WHERE {s}.claim_rank(t, p) IS DISTINCT FROM " + BEFORE
        + ") FROM (SELECT now() + (random() * 2e10 - 1e10) * interval '1 second'"
        "                 + (random() * 1e6) * interval '1 microsecond' AS t,"
        "                 (random() * 2000 - 1000)::integer AS p"
        "          FROM generate_series(1, 20000)"
        "          UNION ALL SELECT t, 7 FROM unnest(ARRAY['infinity', '-infinity',"
        "              '1970-01-01 00:00:00+00', '2000-02-29 23:59:59.999999+14',"
        "              '4713-01-01 00:00:00+00 BC', '294276-12-31 23:59:59.999999+00']"
        "              ::timestamptz[]) AS u(t)) AS s").format(s=sql.Identifier(schema))
    with psycopg.connect(dsn, autocommit=True) as conn:
        for zone in ZONES:
            conn.execute(sql.SQL("SET TIME ZONE {}").format(sql.Literal(zone)))
            assert conn.execute(query).fetchone() == (20006, 0), zone


def test_jobs_indexed_before_0020_are_found_in_rank_order_after_it(
        dsn: str, at_19: str) -> None:
    s = sql.Identifier(at_19)
    walk = sql.SQL(
        "SELECT j.id FROM {s}.jobs j WHERE j.status = 'pending' AND j.effect = 'rank.e'"
        " AND coalesce(j.group_key, '') = '' AND {s}.claim_rank(j.available_at, j.priority)"
        " <= date_part('epoch', now()) - %s"
        " ORDER BY {s}.claim_rank(j.available_at, j.priority), j.id").format(s=s)
    expected = sql.SQL(
        "SELECT j.id FROM {s}.jobs j, LATERAL (SELECT j.available_at AS t,"
        " j.priority AS p) x WHERE j.effect = 'rank.e' AND " + BEFORE
        + " <= date_part('epoch', now()) - %s ORDER BY " + BEFORE + ", j.id").format(s=s)
    with psycopg.connect(dsn, autocommit=True) as conn, \
            psycopg.connect(dsn, autocommit=True) as other:
        # Indexed by 0010's function: times to the microsecond, every priority band.
        conn.execute(sql.SQL(
            "INSERT INTO {s}.jobs (effect, key, payload, fingerprint, available_at, priority)"
            " SELECT 'rank.e', 'k' || n, '{{}}', 'f', now() - (n % 997) * interval '1.000123 s'"
            "        + (n % 13) * interval '1 microsecond', (n % 21) * 100 - 1000"
            " FROM generate_series(1, 3000) AS n").format(s=s))
        conn.execute(sql.SQL("ANALYZE {s}.jobs").format(s=s))
        for session in (conn, other):  # both walk the index before 0020 (their caches)
            session.execute("SET enable_seqscan = off")
            session.execute("SET enable_bitmapscan = off")
            session.execute(walk, (0.0,), prepare=True).fetchall()
        migrate(conn, at_19)
        for session in (conn, other):
            plan = "\n".join(str(r[0]) for r in session.execute(sql.SQL("EXPLAIN ") + walk,
                                                                  (0.0,)))
            # the index gives the order, in the session that migrated and in one that
            # had read the index before
            assert "jobs_fair" in plan and "Sort" not in plan, plan
        conn.execute("SET enable_seqscan = on")
        conn.execute("SET enable_indexscan = off")  # the same question without the index
        wanted = {bound: conn.execute(expected, (bound,)).fetchall() for bound in (0.0, 9000.0)}
        for bound, ids in wanted.items():
            assert len(ids) > 100
            assert other.execute(walk, (bound,), prepare=True).fetchall() == ids
