"""The table effect with completion hooks, for the flow windows (``worker --hooks``).

``on_done`` writes ``hooked(key, claim_version, pid)`` (no unique key: a second run of
the hook for a key would show as a second row) and enqueues the follow-up
``followup-<key>`` (with the job's ordering key), in the recorder's transaction. A
``pause`` at point ``"hook"`` (e.g. ``{"1": "hook"}``) records a checkpoint after those
writes and blocks there, mid-transaction, until released or killed.
"""

from __future__ import annotations

import asyncio
from typing import Any

from psycopg import sql

import outbox

from .provider import EFFECT, Conn, TableEffect

HOOKED_DDL = """
CREATE TABLE {schema}.hooked (key text NOT NULL, claim_version bigint NOT NULL,
                              pid integer NOT NULL)
"""


def create_hooked_table(conn: Conn, schema: str) -> None:
    conn.execute(sql.SQL(HOOKED_DDL).format(schema=sql.Identifier(schema)))


def hooked(conn: Conn, schema: str) -> list[tuple[str, int]]:
    """(key, claim_version) of every hook run that committed, by key."""
    rows = conn.execute(sql.SQL("SELECT key, claim_version FROM {}.hooked ORDER BY key, 2")
                        .format(sql.Identifier(schema))).fetchall()
    return [(r[0], r[1]) for r in rows]


def _insert(schema: str) -> sql.Composed:
    return sql.SQL("INSERT INTO {}.hooked VALUES (%s, %s, pg_backend_pid())").format(
        sql.Identifier(schema))


class HookedTableEffect(TableEffect):
    """``TableEffect`` with a plain ``on_done``."""

    def __init__(self, dsn: str, schema: str) -> None:
        super().__init__(dsn, schema)
        self.schema = schema

    def on_done(self, tx: outbox.HookTransaction, job: outbox.Job, result: Any) -> None:
        tx.execute(_insert(self.schema), (job.key, job.claim_version))
        if not job.key.startswith("followup-"):
            tx.enqueue(EFFECT, key=f"followup-{job.key}", payload={"parent": job.key,
                       "trace": job.payload.get("trace", False)},
                       ordering_key=job.ordering_key)
        self._at(job, "hook")


class AsyncHookedTableEffect(outbox.Effect):
    """The same behind ``async def`` perform and ``on_done`` (AsyncDispatcher)."""

    name = EFFECT

    def __init__(self, inner: HookedTableEffect) -> None:
        self.inner = inner

    async def perform(self, job: outbox.Job) -> dict[str, Any]:
        return await asyncio.to_thread(self.inner.perform, job)

    async def on_done(self, tx: outbox.AsyncHookTransaction, job: outbox.Job,
                      result: Any) -> None:
        await tx.execute(_insert(self.inner.schema), (job.key, job.claim_version))
        if not job.key.startswith("followup-"):
            await tx.enqueue(EFFECT, key=f"followup-{job.key}", payload={"parent": job.key,
                       "trace": job.payload.get("trace", False)},
                             ordering_key=job.ordering_key)
        await asyncio.to_thread(self.inner._at, job, "hook")


def drain_hooked(dsn: str, schema: str, *, lease: float = 1.0,
                 timeout: float = 60.0) -> outbox.DispatchStats:
    """An in-process dispatcher with the hooked effect, until idle (the rescuer)."""
    effect = HookedTableEffect(dsn, schema)
    try:
        return outbox.Dispatcher(dsn, [effect], schema=schema, lease=lease,
                                 rescue_interval=0.1).run_until_idle(timeout=timeout)
    finally:
        effect.close()

