"""Once across crashes: a worker killed between publish and done, a broker restarted."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg.rows import dict_row

import outbox
from effects.nats import PublishEvent
from effects.testing import NatsServer
from outbox.testing import jobs
from tests.crash.support import Worker, lease_expired, wait_until
from tests.testkit import worker

from .support import add_stream, make_job, per_key, stored_count


@pytest.fixture
def db(dsn: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        yield conn


def enqueue_events(conn: psycopg.Connection[tuple[object, ...]], schema: str, stream: str,
                   keys: list[str]) -> None:
    with outbox.transaction(conn, schema=schema) as tx:
        for key in keys:
            tx.enqueue("nats.publish", key=key,
                       payload={"subject": f"{stream}.orders.paid", "data": {"key": key}})


def start_worker(mode: str, dsn: str, schema: str, server: NatsServer, stream: str,
                 log_dir: Path) -> Worker:
    return worker.start("tests.events.worker", mode, dsn, log_dir, "--schema", schema,
                        "--nats", server.url, "--stream", stream)


def ledger_result(conn: psycopg.Connection[tuple[object, ...]], schema: str,
                  key: str) -> object:
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(f'SELECT result FROM "{schema}".effect_results WHERE key = %s', (key,))
        row = cur.fetchone()
    return None if row is None else row["result"]


def test_a_worker_killed_after_publish_and_before_done_publishes_once(
    dsn: str, schema: str, db: psycopg.Connection[tuple[object, ...]],
    nats_server: NatsServer, tmp_path: Path,
) -> None:
    stream = add_stream(nats_server.url, duplicate_window=120.0)
    enqueue_events(db, schema, stream, ["evt-order-102-paid"])

    worker = start_worker("hang-after-publish", dsn, schema, nats_server, stream, tmp_path)
    try:
        published = worker.read_json_line()
        assert published["result"]["duplicate"] is False
        worker.kill()  # kill -9 between the broker's ack and done
    finally:
        worker.cleanup()
    assert jobs(db, schema)["evt-order-102-paid"]["status"] == "running"
    wait_until(lambda: lease_expired(db, schema, "evt-order-102-paid"), "the lease to expire")

    rescuer = start_worker("drain", dsn, schema, nats_server, stream, tmp_path)
    stats = rescuer.finish()

    assert stats["done"] == 1
    assert jobs(db, schema)["evt-order-102-paid"]["status"] == "done"
    assert ledger_result(db, schema, "evt-order-102-paid") == {
        "stream": stream, "seq": published["result"]["seq"], "duplicate": True}
    assert per_key(nats_server.url, stream) == {"evt-order-102-paid": 1}


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_broker_restarted_mid_run_loses_nothing_and_duplicates_nothing(
    dsn: str, schema: str, db: psycopg.Connection[tuple[object, ...]], how: str,
) -> None:
    keys = [f"evt-{n}" for n in range(500)]
    with NatsServer() as server:
        stream = add_stream(server.url, duplicate_window=120.0)
        enqueue_events(db, schema, stream, keys)
        restarted = threading.Event()

        def restart_once_some_are_stored() -> None:
            wait_until(lambda: stored_count(server.url, stream) >= 50,
                       "some events to be stored")
            if how == "kill":
                server.kill()  # a crash: no goodbye to the clients
            else:
                server.stop()
            server.start()
            restarted.set()

        with PublishEvent(server.url, stream, timeout=1.0, lease=2.0,
                          rescue_interval=0.1) as publisher:
            chaos = threading.Thread(target=restart_once_some_are_stored)
            chaos.start()
            dispatcher = outbox.Dispatcher(
                dsn, [publisher], schema=schema, lease=2.0, rescue_interval=0.1,
                poll_interval=0.05, concurrency=4, backoff=outbox.Backoff(base=0.05, cap=0.5),
            )
            first = dispatcher.run_until_idle(timeout=120)
            chaos.join()
            assert restarted.is_set()

            def all_done() -> bool:
                # Jobs retried across the restart may still be waiting out their backoff.
                dispatcher.run_until_idle(timeout=120)
                return all(j["status"] == "done" for j in jobs(db, schema).values())

            wait_until(all_done, "every job to be done")

        counts = per_key(server.url, stream)

    # The restart hit the run: some attempts failed and were retried.
    assert first.retried >= 1
    assert first.failed == 0
    assert set(counts) == set(keys)
    assert max(counts.values()) == 1


def test_an_unknown_outcome_past_the_window_goes_to_reconcile_without_publishing_again(
    dsn: str, schema: str, db: psycopg.Connection[tuple[object, ...]],
) -> None:
    with NatsServer() as server:
        stream = add_stream(server.url, duplicate_window=60.0)
        enqueue_events(db, schema, stream, ["evt-frozen"])
        with PublishEvent(server.url, stream, timeout=0.5, lease=2.0,
                          rescue_interval=0.1) as publisher:
            publisher.check()
            dispatcher = outbox.AsyncDispatcher(
                dsn, [publisher], schema=schema, lease=2.0, rescue_interval=0.1,
                poll_interval=0.05, backoff=outbox.Backoff(base=0.05, cap=0.1),
                unknown_outcome_window=publisher.unknown_outcome_window or 0.0,
            )

            async def scenario() -> outbox.DispatchStats:
                # The dispatcher's loop has its connection up before the broker freezes.
                await publisher.perform(make_job("evt-warm", {
                    "subject": f"{stream}.orders.warm", "data": {}}))
                server.freeze()  # every thread stopped: the publish is written, never answered
                try:
                    first = await dispatcher.run_until_idle(timeout=60)
                finally:
                    server.thaw()
                # The first attempt was stored after all; pretend the window has passed.
                db.execute(f'UPDATE "{schema}".jobs SET first_attempted_at = now() - '
                           "interval '10 minutes', available_at = now()")
                await dispatcher.run_until_idle(timeout=60)
                return first

            first = asyncio.run(scenario())

        job = jobs(db, schema)["evt-frozen"]
        counts = per_key(server.url, stream)

    # UnknownOutcome inside the window: retried (each retry written, unanswered).
    assert first.retried >= 1
    assert first.done == first.reconcile == 0
    assert job["status"] == "reconcile"
    assert "past the stream's duplicate window" in job["last_error"]
    assert counts == {"evt-warm": 1, "evt-frozen": 1}
