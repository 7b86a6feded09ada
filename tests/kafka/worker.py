"""A dispatcher process producing to Kafka, for the crash tests.

Modes (``OUTBOX_DATABASE_URL`` names the database; the harness is
``tests.testkit.worker``)::

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
from typing import Any

from psycopg import sql

import outbox
from effects.kafka import InboxConsumer, KafkaEvent, Produce
from tests.testkit.worker import Mode, block, database_url, drain, hang, main, report


class ProduceThenHang(Produce):
    """Produces, reports it, and never returns: the window between the ack and done."""

    async def perform(self, job: outbox.Job) -> dict[str, Any]:
        result = await super().perform(job)
        report({"produced": job.key, "result": result})
        await hang()


def record(tx: outbox.Transaction, event: KafkaEvent) -> None:
    """The business work of the consumer tests: one row per handling."""
    tx.connection.execute(
        sql.SQL("INSERT INTO {}.handled (message_id, part, off) VALUES (%s, %s, %s)")
        .format(sql.Identifier(tx.schema)), (event.message_id, event.partition, event.offset))


class CommitThenHang(InboxConsumer):
    """Commits its first batch in PostgreSQL, reports it, and never commits to Kafka."""

    def _handle(self, events: list[KafkaEvent]) -> Any:
        super()._handle(events)
        report({"committed": [e.message_id for e in events]})
        block()


def consume(args: argparse.Namespace) -> None:
    CommitThenHang(database_url(), record, bootstrap_servers=args.bootstrap,
                   topics=[args.topic], group="billing", schema=args.schema, batch=7,
                   config={"session.timeout.ms": 6000, "heartbeat.interval.ms": 500}).run()


def dispatch(kind: type[Produce]) -> Mode:
    def mode(args: argparse.Namespace) -> None:
        effect = kind(args.bootstrap)
        drain(effect, effect.close, args)
    return mode


def kafka_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--topic")


if __name__ == "__main__":
    main({"hang-after-produce": dispatch(ProduceThenHang), "drain": dispatch(Produce),
          "consume-hang-before-offset-commit": consume}, kafka_arguments)
