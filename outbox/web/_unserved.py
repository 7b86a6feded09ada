"""The overview's "no running dispatcher handles this effect": the effects with due jobs
that no live dispatcher serves (a misspelt effect name, a dispatcher not deployed), each
with the served effect its name is closest to, as ``outbox status`` flags them."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.rows import dict_row

from .. import _queue
from .._sql import queries
from ..registry import closest


async def unserved(conn: psycopg.AsyncConnection[Any], schema: str) -> dict[str, str | None]:
    """Each effect with due jobs and no live dispatcher -> the closest served effect
    name (None when none is close). Two statements, in the caller's transaction."""
    backlog = await _queue.on_async(conn, _queue.backlog(schema))
    waiting = [effect for effect, b in backlog.items() if b.due and not b.dispatchers]
    if not waiting:
        return {}
    cur = conn.cursor(row_factory=dict_row)
    await cur.execute(queries(schema).live_dispatchers)
    served = {effect for row in await cur.fetchall() for effect in row["effects"]}
    return {effect: closest(effect, served) for effect in waiting}
