"""Three dispatcher processes declaring the same one-second schedules: one killed with
SIGKILL and restarted, then all stopped for 6 s and one started again. Each slot is
enqueued once and performed once at the provider; ``all`` has every slot from the first
to the last, the downtime's included; ``latest`` only the latest slot of the downtime."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

import outbox
from tests.crash.support import Worker, wait_until

from .worker import DDL, Provider

REPO = Path(__file__).resolve().parents[2]
DOWNTIME = 6.0  # seconds with no dispatcher running (the scenario, not a synchronisation)
SECOND = timedelta(seconds=1)

Conn = psycopg.Connection[tuple[Any, ...]]


class Fleet:
    """Starts ``tests.schedules.worker`` processes; kills what is left at the end."""

    def __init__(self, dsn: str, schema: str, log_dir: Path) -> None:
        self.dsn, self.schema, self.log_dir = dsn, schema, log_dir
        self.started: list[Worker] = []

    def start(self, *options: str) -> Worker:
        env = dict(os.environ, OUTBOX_DATABASE_URL=self.dsn)
        env.setdefault("XDG_RUNTIME_DIR", str(REPO / ".runtime"))
        log_path = self.log_dir / f"dispatcher-{len(self.started)}.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.schedules.worker", "--schema", self.schema,
                 *options],
                cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log,
                stdin=subprocess.DEVNULL)
        worker = Worker(proc, log_path)
        self.started.append(worker)
        return worker

    def cleanup(self) -> None:
        for worker in self.started:
            if worker.proc.poll() is None:
                worker.proc.kill()
            worker.proc.wait(timeout=30)


@pytest.fixture
def fleet(dsn: str, schema: str, tmp_path: Path) -> Iterator[Fleet]:
    started = Fleet(dsn, schema, tmp_path)
    yield started
    started.cleanup()


def _query(db: Conn, schema: str, text: str) -> list[tuple[Any, ...]]:
    return db.execute(sql.SQL(text).format(s=sql.Identifier(schema))).fetchall()


def _performed(db: Conn, schema: str, name: str, after: datetime | None = None) -> int:
    [(count,)] = db.execute(sql.SQL(
        "SELECT count(*) FROM {s}.performed WHERE key LIKE %s AND slot > %s").format(
            s=sql.Identifier(schema)),
        (f"schedule:{name}:%", after or datetime(1970, 1, 1).astimezone())).fetchall()
    return int(count)


def _stop(worker: Worker) -> None:
    worker.proc.terminate()
    assert worker.proc.wait(timeout=60) == 0, worker.log()


def test_three_dispatchers_a_kill_and_a_downtime_fire_each_slot_once(
        dsn: str, schema: str, fleet: Fleet) -> None:
    with psycopg.connect(dsn, autocommit=True) as db:
        db.execute(sql.SQL(DDL).format(schema=sql.Identifier(schema)))
        workers = [fleet.start() for _ in range(3)]
        wait_until(lambda: _performed(db, schema, "all") >= 3, "three slots performed", 60)
        workers[0].kill()  # SIGKILL, wherever it was
        workers[0] = fleet.start()
        done = _performed(db, schema, "all")
        wait_until(lambda: _performed(db, schema, "all") >= done + 3,
                   "three more slots after the kill", 60)
        for worker in workers:
            worker.proc.terminate()
        for worker in workers:
            assert worker.proc.wait(timeout=60) == 0, worker.log()
        [(stopped,)] = db.execute("SELECT now()").fetchall()
        time.sleep(DOWNTIME)
        [(restarted,)] = db.execute("SELECT now()").fetchall()
        last = fleet.start()
        wait_until(lambda: _performed(db, schema, "all", restarted + 2 * SECOND) >= 2,
                   "slots performed after the restart", 60)
        _stop(last)
        # What was enqueued but not performed before the stop: pause the schedules (no new
        # slot) and drain.
        _query(db, schema, "UPDATE {s}.schedules SET paused = true RETURNING name")
        outbox.Dispatcher(dsn, effects=[Provider(dsn, schema)], schema=schema,
                          lease=2.0).run_until_idle(timeout=60)

        jobs = _query(db, schema, "SELECT key, scheduled_for, created_at, status, attempts "
                                  "FROM {s}.jobs ORDER BY scheduled_for")
        performed = {key: (slot, deliveries) for key, slot, deliveries in _query(
            db, schema, "SELECT key, slot, deliveries FROM {s}.performed")}

    # Every job came from a schedule, was performed, once at the provider.
    assert {status for *_, status, _ in jobs} == {"done"}
    assert set(performed) == {key for key, *_ in jobs}
    for key, slot, _created, _status, attempts in jobs:
        assert performed[key][0] == slot
        # A second delivery only to a job whose worker was killed holding it (re-claimed
        # after its lease: at least once to the effect, once at the provider per key).
        assert performed[key][1] == 1 or attempts > 1, key
    by_name: dict[str, list[tuple[datetime, datetime]]] = {"all": [], "latest": []}
    for key, slot, created, *_ in jobs:
        by_name[key.split(":")[1]].append((slot, created))
    every = [slot for slot, _ in by_name["all"]]
    latest = [slot for slot, _ in by_name["latest"]]
    # One job per slot; "all": every second from the first slot to the last, no gap.
    assert len(every) == len(set(every)) and len(latest) == len(set(latest))
    assert every == [every[0] + i * SECOND for i in range(len(every))]
    assert every[0] < stopped and every[-1] > restarted
    # "latest": before the stop, its slots run alongside; then one slot for the whole
    # downtime: enqueued by the first round after the restart, in which "all" caught up
    # every slot of the downtime and "latest" only the latest of them.
    before = max(s for s in latest if s <= stopped)
    resumed, resumed_at = min((s, c) for s, c in by_name["latest"] if s > before)
    assert resumed - before >= timedelta(seconds=DOWNTIME)
    caught_up = [s for s, c in by_name["all"] if c == resumed_at]
    assert resumed == max(caught_up)
    assert len([s for s in caught_up if s > before]) >= DOWNTIME - 1
    assert [s for s in latest if before < s < resumed] == []


# Berlin's autumn night (03:00 CEST -> 02:00 CET at 01:00 UTC) on a fake clock at 1800
# times real speed (half an hour a second), the same in every process.
# Four hours before the changes (eight seconds), for the processes to start.
NIGHT = datetime(2026, 10, 24, 20, 0, tzinfo=UTC)  # 22:00 CEST
SPEED = 1800.0


def _slots(db: Conn, schema: str, name: str) -> list[datetime]:
    return [slot for (slot,) in db.execute(sql.SQL(
        "SELECT slot FROM {s}.performed WHERE key LIKE %s ORDER BY slot").format(
            s=sql.Identifier(schema)), (f"schedule:{name}:%",)).fetchall()]


def test_three_dispatchers_through_a_dst_night_fire_each_cron_slot_once(
        dsn: str, schema: str, fleet: Fleet) -> None:
    """The cron schedules "30 2 * * *" and "*/30 * * * *" in Europe/Berlin, catch_up
    "all", through the night the clock goes back, with a SIGKILL, a restart and all
    dispatchers down for hours of the fake clock: the nightly job once, at the first
    02:30; the half-hourly one at every half hour of real time, the repeated hour twice."""
    clock = ["--dst", "--clock", NIGHT.isoformat(), repr(time.time() + 1), repr(SPEED)]
    with psycopg.connect(dsn, autocommit=True) as db:
        db.execute(sql.SQL(DDL).format(schema=sql.Identifier(schema)))
        workers = [fleet.start(*clock) for _ in range(3)]
        wait_until(lambda: len(_slots(db, schema, "half")) >= 2, "two half hours", 60)
        workers[0].kill()
        workers[0] = fleet.start(*clock)
        done = len(_slots(db, schema, "half"))
        wait_until(lambda: len(_slots(db, schema, "half")) >= done + 2, "two more", 60)
        for worker in workers:
            worker.proc.terminate()
        for worker in workers:
            assert worker.proc.wait(timeout=60) == 0, worker.log()
        stopped = _slots(db, schema, "half")[-1]
        time.sleep(3.0)  # an hour and a half of the fake clock with no dispatcher
        last = fleet.start(*clock)
        dawn = datetime(2026, 10, 25, 3, 0, tzinfo=UTC)  # 04:00 CET
        # The night over, and the downtime's slots caught up by the restarted dispatcher.
        until = max(dawn, stopped + timedelta(hours=2))
        wait_until(lambda: _slots(db, schema, "half")[-1] >= until, "the night over", 90)
        last.proc.terminate()
        assert last.proc.wait(timeout=60) == 0, last.log()
        _query(db, schema, "UPDATE {s}.schedules SET paused = true RETURNING name")
        outbox.Dispatcher(dsn, effects=[Provider(dsn, schema)], schema=schema,
                          lease=2.0).run_until_idle(timeout=60)
        half, nightly = _slots(db, schema, "half"), _slots(db, schema, "nightly")
        jobs = _query(db, schema, "SELECT key, status, attempts FROM {s}.jobs")
        deliveries = dict(_query(db, schema, "SELECT key, deliveries FROM {s}.performed"))

    assert {status for _, status, _ in jobs} == {"done"}
    assert all(deliveries[key] == 1 or attempts > 1 for key, _, attempts in jobs)
    # Every half hour of real time from the first to the last, the downtime's too.
    assert half == [half[0] + i * timedelta(minutes=30) for i in range(len(half))]
    assert half[0] <= stopped < stopped + 2 * timedelta(minutes=30) < half[-1]
    # 02:00 and 02:30 twice (CEST at 00:00 and 00:30 UTC, CET at 01:00 and 01:30 UTC).
    night = datetime(2026, 10, 25, 0, 0, tzinfo=UTC)
    assert [s for s in half if night <= s < night + timedelta(hours=2)] == [
        night + i * timedelta(minutes=30) for i in range(4)]
    # The nightly job once, at the first 02:30 (CEST), not again at the second.
    assert nightly == [datetime(2026, 10, 25, 0, 30, tzinfo=UTC)]
