"""A dispatcher process producing to Kafka, for the crash tests.

Modes (``OUTBOX_DATABASE_URL`` names the database)::

``hang-after-produce``  a ``Dispatcher`` whose ``kafka.produce`` effect, once the broker
                        acknowledged, prints ``{"produced": key, "result": ...}`` and
                        hangs before returning: ``done`` is never recorded.
``drain``               ``run_until_idle``; prints the dispatcher's stats.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

import outbox
from effects.kafka import Produce


class ProduceThenHang(Produce):
    """Produces, reports it, and never returns: the window between the ack and done."""

    async def perform(self, job: outbox.Job) -> dict[str, Any]:
        result = await super().perform(job)
        sys.stdout.write(json.dumps({"produced": job.key, "result": result}) + "\n")
        sys.stdout.flush()
        await asyncio.Event().wait()  # until killed
        return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["hang-after-produce", "drain"])
    parser.add_argument("--schema", required=True)
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--lease", type=float, default=1.0)
    args = parser.parse_args()
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
