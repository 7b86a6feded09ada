"""A dispatcher process publishing to NATS: ``python -m tests.events.worker MODE ...``.

The DSN comes from ``$OUTBOX_DATABASE_URL``; the harness is ``tests.testkit.worker``.
Modes:

``hang-after-publish``  runs a dispatcher whose ``nats.publish`` effect, once the broker
                        acknowledged, prints ``{"published": key, "result": ...}`` and
                        hangs before returning: ``done`` is never recorded.
``drain``               ``run_until_idle``; prints the dispatcher's stats.
``consume-hang-before-ack``  an ``InboxConsumer`` (name ``billing``) whose handler
                        records the message in ``<schema>.handled``; after the commit,
                        instead of acking, it prints ``{"committed": message_id}`` and
                        hangs.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from nats.aio.msg import Msg
from psycopg import sql

import outbox
from effects.nats import InboxConsumer, InboxEvent, PublishEvent
from tests.testkit.worker import Mode, database_url, drain, hang, main, report


class PublishThenHang(PublishEvent):
    """Publishes, reports it, and never returns: the window between publish and done."""

    async def perform(self, job: outbox.Job) -> dict[str, Any]:
        result = await super().perform(job)
        report({"published": job.key, "result": result})
        await hang()


def record(tx: outbox.Transaction, event: InboxEvent) -> None:
    """The business work of the consumer tests: one row per handling."""
    tx.connection.execute(
        sql.SQL("INSERT INTO {}.handled (message_id, deliveries) VALUES (%s, %s)")
        .format(sql.Identifier(tx.schema)), (event.message_id, event.deliveries))


class CommitThenHang(InboxConsumer):
    """Commits the handling, reports it, and never acks: the window before the ack."""

    async def _acknowledge(self, messages: list[Msg]) -> None:
        report({"committed": [m.header for m in messages]})
        await hang()


def consume(args: argparse.Namespace) -> None:
    consumer = CommitThenHang(database_url(), record, servers=args.nats, stream=args.stream,
                              name="billing", schema=args.schema, ack_wait=1.0)
    asyncio.run(consumer.run())


def dispatch(kind: type[PublishEvent]) -> Mode:
    def mode(args: argparse.Namespace) -> None:
        effect = kind(args.nats, args.stream, lease=args.lease, rescue_interval=0.1)
        drain(effect, effect.close, args)
    return mode


def nats_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats", required=True)
    parser.add_argument("--stream", required=True)


if __name__ == "__main__":
    main({"hang-after-publish": dispatch(PublishThenHang), "drain": dispatch(PublishEvent),
          "consume-hang-before-ack": consume}, nats_arguments)
