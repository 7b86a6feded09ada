"""AsyncDispatcher's reconciler with a plain ``reconcile`` and a plain ``on_done``: the
answer is written on a thread with a blocking connection (the program that writes it,
driven there), its hook's follow-up in the same transaction as the job's done."""

from __future__ import annotations

import threading
from typing import Any

import outbox
from outbox import NewJob

from .test_reconcile import LOSSY, Lossy, Provider, _enqueue, _jobs, _ledger, _run


class ThreadNoting(Lossy):
    """``Lossy``, noting the thread each ``on_done`` ran on."""

    def __init__(self, provider: Provider, schema: str) -> None:
        super().__init__(provider, schema)
        self.threads: list[int] = []

    def on_done(self, tx: outbox.HookTransaction, job: outbox.Job, result: Any) -> None:
        self.threads.append(threading.get_ident())
        super().on_done(tx, job, result)


def test_async_dispatcher_writes_a_plain_hooks_answer_on_a_thread(dsn: str, schema: str) -> None:
    provider = Provider()
    effect = ThreadNoting(provider, schema)
    _enqueue(dsn, schema, NewJob(LOSSY, "order-1", {"lose": True}))
    _run("async", dsn, schema, effect)  # the lost answer: reconcile
    assert _jobs(dsn, schema)["order-1"]["status"] == "reconcile"
    _run("async", dsn, schema, effect)  # the reconciler's pass, then its follow-up
    found = _jobs(dsn, schema)
    assert found["order-1"]["status"] == "done"
    assert found["note-order-1"]["status"] == "done"  # the hook's follow-up, adopted
    assert _ledger(dsn, schema)["order-1"]["result"] == {"id": "pi_order-1",
                                                         "found_by": "reconcile"}
    assert effect.done == [("order-1", {"id": "pi_order-1", "found_by": "reconcile"})]
    assert effect.threads and threading.get_ident() not in effect.threads
