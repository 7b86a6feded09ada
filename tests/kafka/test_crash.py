"""At least once across a producer killed between the broker's ack and done."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psycopg

import outbox
from effects.testing import KafkaMockCluster
from outbox.testing import jobs, ledger
from tests.crash.support import REPO, Worker, lease_expired, wait_until

from .support import records


def start_worker(mode: str, dsn: str, schema: str, kafka: KafkaMockCluster,
                 log_dir: Path) -> Worker:
    env = dict(os.environ, OUTBOX_DATABASE_URL=dsn)
    env.setdefault("XDG_RUNTIME_DIR", str(REPO / ".runtime"))
    log_path = log_dir / f"worker-{mode}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.kafka.worker", mode, "--schema", schema,
             "--bootstrap", kafka.bootstrap_servers],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
        )
    return Worker(proc, log_path)


def test_a_producer_killed_after_the_ack_and_before_done_produces_again_with_its_key(
    dsn: str, schema: str, kafka: KafkaMockCluster, topic: str, tmp_path: Path,
) -> None:
    key = "evt-order-102-paid"
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue("kafka.produce", key=key, ordering_key="order-102",
                   payload={"topic": topic, "value": {"order": 102}})

    worker = start_worker("hang-after-produce", dsn, schema, kafka, tmp_path)
    try:
        produced = worker.read_json_line()
        worker.kill()  # kill -9 between the broker's ack and done
    finally:
        worker.cleanup()
    with psycopg.connect(dsn, autocommit=True) as db:
        assert jobs(db, schema)[key]["status"] == "running"
        wait_until(lambda: lease_expired(db, schema, key), "the lease to expire")

    stats = start_worker("drain", dsn, schema, kafka, tmp_path).finish()

    assert stats["done"] == 1
    assert jobs(dsn, schema)[key]["status"] == "done"
    # Kafka has no dedup by our key: the message is there twice, both with its key, the
    # same bytes and the same message key (so the same partition); the ledger has one row.
    first, second = records(kafka.bootstrap_servers, topic)
    assert first.headers["outbox-key"] == second.headers["outbox-key"] == key.encode()
    assert (first.value, first.key, first.partition) == (second.value, second.key,
                                                         second.partition)
    assert produced["result"] == {"topic": topic, "partition": first.partition,
                                  "offset": first.offset}
    assert ledger(dsn, schema)[key]["result"] == {"topic": topic, "partition": second.partition,
                                                 "offset": second.offset}
