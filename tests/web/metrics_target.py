"""A dispatcher for ``outbox run tests.web.metrics_target:dispatcher --metrics-port N``."""

from __future__ import annotations

import os

import outbox


class Noop(outbox.Effect):
    name = "test.noop"

    def perform(self, job: outbox.Job) -> None:
        return None


def dispatcher() -> outbox.Dispatcher:
    return outbox.Dispatcher(os.environ["OUTBOX_TEST_TARGET_DSN"], [Noop()],
                             schema=os.environ["OUTBOX_TEST_TARGET_SCHEMA"], poll_interval=0.05)
