"""A dispatcher process publishing to NATS: ``python -m tests.events.worker MODE ...``.

The DSN comes from ``$OUTBOX_DATABASE_URL``. Modes:

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
import json
import os
import sys
from typing import Any

from nats.aio.msg import Msg
from psycopg import sql

import outbox
from effects.nats import InboxConsumer, InboxEvent, PublishEvent


class PublishThenHang(PublishEvent):
    """Publishes, reports it, and never returns: the window between publish and done."""

    async def perform(self, job: outbox.Job) -> dict[str, Any]:
        result = await super().perform(job)
        sys.stdout.write(json.dumps({"published": job.key, "result": result}) + "\n")
        sys.stdout.flush()
        await asyncio.Event().wait()  # until killed
        return result


def record(tx: outbox.Transaction, event: InboxEvent) -> None:
    """The business work of the consumer tests: one row per handling."""
    tx.connection.execute(
        sql.SQL("INSERT INTO {}.handled (message_id, deliveries) VALUES (%s, %s)")
        .format(sql.Identifier(tx.schema)), (event.message_id, event.deliveries))


class CommitThenHang(InboxConsumer):
    """Commits the handling, reports it, and never acks: the window before the ack."""

    async def _acknowledge(self, messages: list[Msg]) -> None:
        sys.stdout.write(json.dumps({"committed": [m.header for m in messages]}) + "\n")
        sys.stdout.flush()
        await asyncio.Event().wait()  # until killed


def consume(args: argparse.Namespace) -> None:
    consumer = CommitThenHang(
        os.environ["OUTBOX_DATABASE_URL"], record, servers=args.nats, stream=args.stream,
        name="billing", schema=args.schema, ack_wait=1.0,
    )
    asyncio.run(consumer.run())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["hang-after-publish", "drain",
                                         "consume-hang-before-ack"])
    parser.add_argument("--schema", required=True)
    parser.add_argument("--nats", required=True)
    parser.add_argument("--stream", required=True)
    parser.add_argument("--lease", type=float, default=1.0)
    args = parser.parse_args()
    if args.mode == "consume-hang-before-ack":
        consume(args)
        return
    kind = PublishThenHang if args.mode == "hang-after-publish" else PublishEvent
    effect = kind(args.nats, args.stream, lease=args.lease, rescue_interval=0.1)
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
