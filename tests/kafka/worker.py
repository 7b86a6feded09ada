"""A dispatcher process producing to Kafka, for the crash tests.

Modes (``OUTBOX_DATABASE_URL`` names the database)::

``hang-after-produce``  a ``Dispatcher`` whose ``kafka.produce`` effect, once the broker
                        acknowledged, prints ``{"produced": key, "result": ...}`` and
                        hangs before returning: ``done`` is never recorded.
``drain``               ``run_until_idle``; prints the dispatcher's stats.
``consume-hang-before-offset-commit``  a Kafka ``InboxConsumer`` (group ``billing``)
                        recording each message in ``<schema>.handled``; after its first
                        batch commits in PostgreSQL, before the offsets reach Kafka, it
                        prints ``{"committed": [message ids]}`` and hangs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
from typing import Any

from psycopg import sql

import outbox
from effects.kafka import InboxConsumer, KafkaEvent, Produce


class ProduceThenHang(Produce):
    """Produces, reports it, and never returns: the window between the ack and done."""

    async def perform(self, job: outbox.Job) -> dict[str, Any]:
        result = await super().perform(job)
        sys.stdout.write(json.dumps({"produced": job.key, "result": result}) + "\n")
        sys.stdout.flush()
        await asyncio.Event().wait()  # until killed
        return result


def record(tx: outbox.Transaction, event: KafkaEvent) -> None:
    """The business work of the consumer tests: one row per handling."""
    tx.connection.execute(
        sql.SQL("INSERT INTO {}.handled (message_id, part, off) VALUES (%s, %s, %s)")
        .format(sql.Identifier(tx.schema)), (event.message_id, event.partition, event.offset))


class CommitThenHang(InboxConsumer):
    """Commits its first batch in PostgreSQL, reports it, and never commits to Kafka."""

    def _handle(self, events: list[KafkaEvent]) -> Any:
        results = super()._handle(events)
        sys.stdout.write(json.dumps({"committed": [e.message_id for e in events]}) + "\n")
        sys.stdout.flush()
        threading.Event().wait()  # until killed
        return results


def consume(args: argparse.Namespace) -> None:
    CommitThenHang(os.environ["OUTBOX_DATABASE_URL"], record, bootstrap_servers=args.bootstrap,
                   topics=[args.topic], group="billing", schema=args.schema, batch=7,
                   config={"session.timeout.ms": 6000, "heartbeat.interval.ms": 500}).run()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["hang-after-produce", "drain",
                                         "consume-hang-before-offset-commit"])
    parser.add_argument("--schema", required=True)
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--lease", type=float, default=1.0)
    parser.add_argument("--topic")
    args = parser.parse_args()
    if args.mode == "consume-hang-before-offset-commit":
        consume(args)
        return
    kind = ProduceThenHang if args.mode == "hang-after-produce" else Produce
    effect = kind(args.bootstrap)
    dispatcher = outbox.Dispatcher(
        os.environ["OUTBOX_DATABASE_URL"], [effect], schema=args.schema, lease=args.lease,
        rescue_interval=0.1, poll_interval=0.05, backoff=outbox.Backoff(base=0.05, cap=0.5),
    )
    try:
        stats = dispatcher.run_until_idle(timeout=120)
    finally:
        effect.close()
    sys.stdout.write(json.dumps(stats.as_dict()) + "\n")


if __name__ == "__main__":
    main()
