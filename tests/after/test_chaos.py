"""Fan-in under chaos: dispatcher processes killed with -9 and restarted while business
transactions enqueue parents and the children waiting on them (in the same transaction,
or in a later one racing the parents' completion), children of children included.

What must hold: no child is performed before every parent has its ledger row (the child
checks that itself, at each delivery, on its own connection); no effect acts twice (the
provider keeps the first delivery per key); none is left waiting once its parents are
done: every job ends done, each with one ledger row.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

import outbox

from ..crash.support import wait_until
from .chaos_worker import CHILD, DDL, PARENT

REPO = Path(__file__).resolve().parents[2]
PROCESSES = 3
ROUNDS = 40
KILLS = 8


class Fleet:
    def __init__(self, dsn: str, schema: str, log_dir: Path) -> None:
        self.dsn, self.schema, self.log_dir = dsn, schema, log_dir
        self.procs: list[subprocess.Popen[bytes]] = []
        self.kills = 0

    def start(self) -> None:
        env = {**os.environ, "OUTBOX_DATABASE_URL": self.dsn}
        env.setdefault("XDG_RUNTIME_DIR", str(REPO / ".runtime"))
        with (self.log_dir / f"worker-{len(self.procs)}.log").open("wb") as log:
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "tests.after.chaos_worker", "--schema", self.schema],
                cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log,
                stdin=subprocess.DEVNULL))

    def live(self) -> list[subprocess.Popen[bytes]]:
        return [p for p in self.procs if p.poll() is None]

    def kill_one(self, rng: random.Random) -> None:
        victim = rng.choice(self.live())
        victim.kill()  # SIGKILL: no stop, no outcome recorded, leases left to expire
        victim.wait(timeout=30)
        self.kills += 1
        self.start()

    def cleanup(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)


@pytest.fixture
def fleet(dsn: str, schema: str, tmp_path: Path) -> Iterator[Fleet]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL(DDL).format(schema=sql.Identifier(schema)))
    started = Fleet(dsn, schema, tmp_path)
    try:
        yield started
    finally:
        started.cleanup()


def _scalar(dsn: str, query: str, schema: str) -> object:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(sql.SQL(query).format(s=sql.Identifier(schema))).fetchone()
    assert row is not None
    return row[0]


def _enqueue_round(dsn: str, schema: str, r: int, rng: random.Random) -> list[str]:
    """One order: 1 to 4 parents, a child after them (in the same transaction, or in a
    later one that races their completion) and, every fourth order, a grandchild after
    the child and the first parent."""
    parents = [f"p{r}-{i}" for i in range(rng.randint(1, 4))]
    later = r % 3 == 0
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        for key in parents:
            tx.enqueue(PARENT, key=key, payload={})
        if not later:
            tx.enqueue(CHILD, key=f"c{r}", payload={"parents": parents}, after=parents)
    if later:
        time.sleep(rng.uniform(0, 0.05))  # lands before, during or after the parents' done
        with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
            tx.enqueue(CHILD, key=f"c{r}", payload={"parents": parents}, after=parents)
    keys = [*parents, f"c{r}"]
    if r % 4 == 0:
        grand = [f"c{r}", parents[0]]
        with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
            tx.enqueue(CHILD, key=f"g{r}", payload={"parents": grand}, after=grand)
        keys.append(f"g{r}")
    return keys


def test_no_child_early_none_twice_none_left_waiting_under_kill_9(
        dsn: str, schema: str, fleet: Fleet) -> None:
    rng = random.Random(40)
    for _ in range(PROCESSES):
        fleet.start()
    keys: list[str] = []
    next_kill = time.monotonic() + rng.uniform(0.2, 0.6)
    for r in range(ROUNDS):
        keys += _enqueue_round(dsn, schema, r, rng)
        if time.monotonic() >= next_kill and fleet.kills < KILLS:
            fleet.kill_one(rng)
            next_kill = time.monotonic() + rng.uniform(0.2, 0.6)
    while fleet.kills < KILLS:  # the rest of the kills while the queue drains
        fleet.kill_one(rng)
        time.sleep(rng.uniform(0.1, 0.4))  # chaos pacing, not synchronisation

    done = "SELECT count(*) FROM {s}.jobs WHERE status = 'done'"
    wait_until(lambda: _scalar(dsn, done, schema) == len(keys),
               f"{len(keys)} jobs done", timeout=180)

    assert fleet.kills == KILLS
    with psycopg.connect(dsn, autocommit=True) as conn:
        s = sql.Identifier(schema)
        early = conn.execute(sql.SQL("SELECT key, missing FROM {}.early").format(s)).fetchall()
        assert early == [], f"children performed before their parents were done: {early}"
        acted = conn.execute(sql.SQL("SELECT count(*), count(DISTINCT key) FROM {}.acted")
                             .format(s)).fetchone()
        assert acted == (len(keys), len(keys))  # every effect acted, once
        ledger = conn.execute(sql.SQL("SELECT count(*) FROM {}.effect_results").format(s)
                              ).fetchone()
        assert ledger == (len(keys),)
        waiting = conn.execute(sql.SQL(
            "SELECT count(*) FROM {}.jobs WHERE after_waiting > 0").format(s)).fetchone()
        assert waiting == (0,)
        unresolved = conn.execute(sql.SQL(
            "SELECT count(*) FROM {}.after_edges WHERE outcome IS NULL").format(s)).fetchone()
        assert unresolved == (0,)
        deliveries = conn.execute(sql.SQL("SELECT count(*) FROM {}.deliveries").format(s)
                                  ).fetchone()
    assert deliveries is not None and deliveries[0] >= len(keys)  # at least once each
