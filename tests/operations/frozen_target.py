"""A dispatcher for ``outbox run`` in tests: its effect answers how many objects the
process's cyclic collector had frozen when it performed."""

from __future__ import annotations

import gc
import os

import outbox


class FrozenCount(outbox.Effect):
    name = "test.frozen"

    def perform(self, job: outbox.Job) -> dict[str, int]:
        return {"frozen": gc.get_freeze_count()}


def dispatcher() -> outbox.Dispatcher:
    return outbox.Dispatcher(os.environ["OUTBOX_TEST_TARGET_DSN"], [FrozenCount()],
                             schema=os.environ["OUTBOX_TEST_TARGET_SCHEMA"], poll_interval=0.2)
