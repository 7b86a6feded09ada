"""Effects with completion hooks for the flow tests, on both dispatchers.

``flow.charge`` counts its performs per key (what the provider would have been asked) and
returns a PaymentIntent-like result; its ``on_done`` stores the intent on the order
(``paid``, no unique key: a second write would show as a second row) and enqueues the
receipt; its ``on_failed`` marks the order declined and enqueues the declined email. The
payload steers the hooks: ``hook`` = ``"raise_once"`` (raise after writing, on the first
attempt only), ``"raise_always"``, ``"swallow"`` (a statement of the hook fails and the
hook swallows the error) and ``decline`` makes ``perform`` raise ``Permanent``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import Counter
from typing import Any

import psycopg
from psycopg import sql

import outbox

CHARGE = "flow.charge"
RECEIPT = "flow.receipt"
DECLINED = "flow.declined"

DDL = """
CREATE TABLE {schema}.paid (key text NOT NULL, intent text NOT NULL, attempt int NOT NULL);
CREATE TABLE {schema}.declined (key text NOT NULL, reason text NOT NULL);
"""


def dispatch_once(flavour: str, dsn: str, effects: list[Any], *, timeout: float = 60,
                  **options: Any) -> outbox.DispatchStats:
    """One ``run_until_idle``: of a ``Dispatcher`` for flavour "sync", else of an
    ``AsyncDispatcher``."""
    if flavour == "sync":
        return outbox.Dispatcher(dsn, effects, **options).run_until_idle(timeout=timeout)
    dispatcher = outbox.AsyncDispatcher(dsn, effects, **options)
    return asyncio.run(dispatcher.run_until_idle(timeout=timeout))


def create_tables(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL(DDL).format(schema=sql.Identifier(schema)))


def rows(dsn: str, schema: str, table: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(sql.SQL("SELECT * FROM {}.{} ORDER BY 1").format(
            sql.Identifier(schema), sql.Identifier(table))).fetchall()


class HookFailed(Exception):
    """What a steered hook raises."""


class Charge(outbox.Effect):
    """The charge with plain hooks (Dispatcher, or AsyncDispatcher's thread)."""

    name = CHARGE

    def __init__(self, schema: str) -> None:
        self.schema = schema
        self.performed: Counter[str] = Counter()
        self.hook_calls: Counter[str] = Counter()
        self.hook_attempts: dict[str, set[int]] = {}  # the attempts a hook ran at
        self.lock = threading.Lock()

    def charge(self, job: outbox.Job) -> dict[str, Any]:
        with self.lock:
            self.performed[job.key] += 1
        if job.payload.get("decline"):
            raise outbox.Permanent("card declined")
        return {"id": f"pi_{job.key}", "status": "succeeded"}

    def perform(self, job: outbox.Job) -> dict[str, Any]:
        return self.charge(job)

    def _paid(self) -> sql.Composed:
        return sql.SQL("INSERT INTO {}.paid VALUES (%s, %s, %s)").format(
            sql.Identifier(self.schema))

    def _declined(self) -> sql.Composed:
        return sql.SQL("INSERT INTO {}.declined VALUES (%s, %s)").format(
            sql.Identifier(self.schema))

    def steer(self, job: outbox.Job) -> str | None:
        with self.lock:
            self.hook_calls[job.key] += 1
            self.hook_attempts.setdefault(job.key, set()).add(job.attempt)
        hook = job.payload.get("hook")
        if hook == "raise_always" or (hook == "raise_once" and job.attempt == 1):
            raise HookFailed(f"hook broke on attempt {job.attempt}")
        return hook if isinstance(hook, str) else None

    def on_done(self, tx: outbox.HookTransaction, job: outbox.Job, result: Any) -> None:
        tx.execute(self._paid(), (job.key, result["id"], job.attempt))
        tx.enqueue(RECEIPT, key=f"receipt-{job.key}", payload={"intent": result["id"]},
                   ordering_key=job.ordering_key)
        if self.steer(job) == "swallow":
            with contextlib.suppress(psycopg.Error):  # the transaction is aborted now
                tx.execute("SELECT 1/0")

    def on_failed(self, tx: outbox.HookTransaction, job: outbox.Job,
                  error: BaseException) -> None:
        tx.execute(self._declined(), (job.key, str(error)))
        tx.enqueue(DECLINED, key=f"declined-{job.key}", payload={"reason": str(error)})
        self.steer(job)


class AsyncCharge(Charge):
    """The same charge with ``async def`` perform and hooks (AsyncDispatcher)."""

    async def perform(self, job: outbox.Job) -> dict[str, Any]:  # type: ignore[override]
        await asyncio.sleep(0)
        return self.charge(job)

    async def on_done(self, tx: outbox.AsyncHookTransaction, job: outbox.Job,  # type: ignore[override]
                      result: Any) -> None:
        await tx.execute(self._paid(), (job.key, result["id"], job.attempt))
        await tx.enqueue(RECEIPT, key=f"receipt-{job.key}", payload={"intent": result["id"]},
                         ordering_key=job.ordering_key)
        if self.steer(job) == "swallow":
            with contextlib.suppress(psycopg.Error):
                await tx.execute("SELECT 1/0")

    async def on_failed(self, tx: outbox.AsyncHookTransaction, job: outbox.Job,  # type: ignore[override]
                        error: BaseException) -> None:
        await tx.execute(self._declined(), (job.key, str(error)))
        await tx.enqueue(DECLINED, key=f"declined-{job.key}", payload={"reason": str(error)})
        self.steer(job)


class Follow(outbox.Effect):
    """A follow-up (the receipt, the declined email): records what it was handed, and,
    where ``check`` is given, what the database showed of the parent when it ran."""

    def __init__(self, name: str) -> None:
        self.name = name  # type: ignore[misc]
        self.performed: list[str] = []
        self.lock = threading.Lock()

    def perform(self, job: outbox.Job) -> dict[str, Any]:
        with self.lock:
            self.performed.append(job.key)
        return {"sent": job.key}
