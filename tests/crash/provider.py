"""A provider modelled as tables in the test's schema, and the effect that calls it.

The effect writes from its OWN autocommit connections (one per worker thread), never
inside the dispatcher's transactions, exactly as an HTTP provider would be called::

    provider(key, performed)   every delivery that reached the provider: at least once
    acted(key, claim_version)  what an idempotent provider did: once per key (ON CONFLICT
                               DO NOTHING), with the claim that first reached it
    checkpoints(...)           where an effect has got to (key, point, attempt, version, pid)
    releases(key, attempt)     lets an effect paused at a checkpoint go on
    provider_mode(mode)        'up', 'down', '5xx' or 'timeout' (acts, then times out)

The job's payload steers the effect, so one worker process serves every scenario:
``pause`` ("before" or "after" the provider call on the first attempt, or a mapping such
as ``{"1": "before", "2": "after"}`` by attempt) records a checkpoint and blocks until
that attempt is released or the process is killed; ``trace`` records checkpoints without
blocking; ``sleep`` is a slow provider; ``reject`` a permanent refusal; ``switch`` makes
the effect obey ``provider_mode``; ``crash`` kills the worker process (kill -9) on the spot;
``hang`` (an attempt number) acts, records the checkpoint ``hang`` and never returns.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import psycopg
from psycopg import sql
from pydantic import BaseModel

import outbox

EFFECT = "crash.table"
VALIDATED_EFFECT = "crash.validated"
PAUSE_LIMIT = 90.0  # a paused effect that is never released gives up (tests time out first)

Conn = psycopg.Connection[tuple[Any, ...]]

_DDL = """
CREATE TABLE {schema}.provider (key text PRIMARY KEY, performed integer NOT NULL);
CREATE TABLE {schema}.acted (
    key text PRIMARY KEY, claim_version bigint NOT NULL, attempt integer NOT NULL,
    pid integer NOT NULL);
CREATE TABLE {schema}.checkpoints (
    key text NOT NULL, point text NOT NULL, attempt integer NOT NULL,
    claim_version bigint NOT NULL, pid integer NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE {schema}.releases (key text, attempt integer, PRIMARY KEY (key, attempt));
CREATE TABLE {schema}.provider_mode (
    only_row boolean PRIMARY KEY DEFAULT true CHECK (only_row), mode text NOT NULL);
INSERT INTO {schema}.provider_mode (mode) VALUES ('up');
"""

_DELIVER = """
WITH delivery AS (
    INSERT INTO {schema}.provider AS p (key, performed) VALUES (%(key)s, 1)
    ON CONFLICT (key) DO UPDATE SET performed = p.performed + 1
)
INSERT INTO {schema}.acted (key, claim_version, attempt, pid)
VALUES (%(key)s, %(version)s, %(attempt)s, %(pid)s)
ON CONFLICT (key) DO NOTHING
"""

_CHECKPOINT = """
INSERT INTO {schema}.checkpoints (key, point, attempt, claim_version, pid)
VALUES (%(key)s, %(point)s, %(attempt)s, %(version)s, %(pid)s)
"""


def _bind(template: str, schema: str) -> sql.Composed:
    return sql.SQL(template).format(schema=sql.Identifier(schema))


def create_tables(conn: Conn, schema: str) -> None:
    """Create the provider's tables in ``schema`` (autocommit connection or not)."""
    conn.execute(_bind(_DDL, schema))


class TableEffect(outbox.Effect):
    """The effect under test: delivers to the table provider, steered by the payload.

    Thread-safe: each worker thread gets its own provider connection. ``close()`` closes
    them all; call it when the dispatcher using the effect has returned.
    """

    name = EFFECT

    def __init__(self, dsn: str, schema: str) -> None:
        self._dsn = dsn
        self._deliver = _bind(_DELIVER, schema)
        self._checkpoint = _bind(_CHECKPOINT, schema)
        self._released = _bind(
            "SELECT 1 FROM {schema}.releases WHERE key = %s AND attempt = %s", schema)
        self._mode = _bind("SELECT mode FROM {schema}.provider_mode", schema)
        # ``hang``: the attempt (a number in the payload) whose perform acts, then never
        # returns. A wrapper that hangs in its own way (the async one) turns it off.
        self.hangs = True
        self._local = threading.local()
        self._lock = threading.Lock()
        self._opened: list[Conn] = []

    def perform(self, job: outbox.Job) -> dict[str, Any]:
        try:
            return self._perform(job)
        except psycopg.OperationalError as exc:
            # The provider is unreachable (PostgreSQL restarting, connection killed): to
            # the dispatcher this is an outage like any other, retried with the same key.
            self._drop_connection()
            raise outbox.Retry(f"provider unreachable: {type(exc).__name__}", after=0.2) from exc

    def _perform(self, job: outbox.Job) -> dict[str, Any]:
        payload = job.payload
        if payload.get("crash"):
            os.kill(os.getpid(), signal.SIGKILL)  # a poison job: the worker dies, every time
        self._at(job, "before")
        if payload.get("sleep"):
            time.sleep(float(payload["sleep"]))
        mode = self._provider_mode() if payload.get("switch") else "up"
        if mode == "down":
            raise outbox.Retry("provider down: connection refused", after=0.05)
        if mode == "5xx":
            raise RuntimeError("provider answered HTTP 503 Service Unavailable")
        if payload.get("reject"):
            raise outbox.Permanent(str(payload["reject"]))
        self._connection().execute(self._deliver, {
            "key": job.key, "version": job.claim_version, "attempt": job.attempt,
            "pid": os.getpid(),
        })
        if mode == "timeout":
            raise outbox.UnknownOutcome("provider timed out after the request was sent",
                                        after=0.05)
        self._at(job, "after")
        if payload.get("hang") == job.attempt and self.hangs:
            self.checkpoint(job, "hang")
            threading.Event().wait()  # a perform that never returns (the stop must not wait)
        return {"key": job.key, "attempt": job.attempt, "claim_version": job.claim_version}

    def _at(self, job: outbox.Job, point: str) -> None:
        payload = job.payload
        pauses = payload.get("pause") or {}
        if isinstance(pauses, str):
            pauses = {"1": pauses}
        pause = pauses.get(str(job.attempt)) == point
        if not (pause or payload.get("trace")):
            return
        conn = self.checkpoint(job, point)
        deadline = time.monotonic() + PAUSE_LIMIT
        while pause and conn.execute(self._released, (job.key, job.attempt)).fetchone() is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{job.key}: paused {point} the provider call, never released")
            time.sleep(0.02)  # this is the effect being held, not a test waiting

    def checkpoint(self, job: outbox.Job, point: str) -> Conn:
        """Record that ``job`` got to ``point``; return this thread's connection."""
        conn = self._connection()
        conn.execute(self._checkpoint, {
            "key": job.key, "point": point, "attempt": job.attempt,
            "version": job.claim_version, "pid": os.getpid(),
        })
        return conn

    def _provider_mode(self) -> str:
        row = self._connection().execute(self._mode).fetchone()
        assert row is not None
        return str(row[0])

    def _connection(self) -> Conn:
        conn: Conn | None = getattr(self._local, "conn", None)
        if conn is None or conn.closed:
            conn = psycopg.connect(self._dsn, autocommit=True, connect_timeout=5,
                                   application_name="crash provider")
            self._local.conn = conn
            with self._lock:
                self._opened.append(conn)
        return conn

    def _drop_connection(self) -> None:
        conn: Conn | None = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.close()

    def close(self) -> None:
        """Close every provider connection this effect opened."""
        with self._lock:
            opened, self._opened = self._opened, []
        for conn in opened:
            conn.close()


class Charge(BaseModel):
    """The payload ``ValidatedEffect`` accepts."""

    amount: int
    currency: str


class ValidatedEffect(outbox.Effect):
    """An effect that declares a payload model: invalid payloads must never reach it."""

    name = VALIDATED_EFFECT
    payload_model = Charge

    def __init__(self) -> None:
        self.performed: list[str] = []

    def perform(self, job: outbox.Job) -> dict[str, Any]:
        assert isinstance(job.model, Charge)
        self.performed.append(job.key)
        return {"charged": job.model.amount, "currency": job.model.currency}


class Provider:
    """The test's view of the provider tables, on its own autocommit connection."""

    def __init__(self, conn: Conn, schema: str) -> None:
        self._conn = conn
        self._schema = schema

    def _rows(self, template: str, params: Any = None) -> list[tuple[Any, ...]]:
        return self._conn.execute(_bind(template, self._schema), params).fetchall()

    def performed(self) -> dict[str, int]:
        """Deliveries per key (at least once)."""
        return {k: n for k, n in self._rows("SELECT key, performed FROM {schema}.provider")}

    def acted(self) -> dict[str, int]:
        """Keys the provider acted on, with the claim version that first reached it."""
        return {k: v for k, v in self._rows("SELECT key, claim_version FROM {schema}.acted")}

    def checkpoints(self, point: str | None = None) -> list[tuple[str, str, int, int, int]]:
        """(key, point, attempt, claim_version, pid) rows, oldest first."""
        rows = self._rows(
            "SELECT key, point, attempt, claim_version, pid FROM {schema}.checkpoints"
            " WHERE %(point)s::text IS NULL OR point = %(point)s ORDER BY at",
            {"point": point},
        )
        return [(r[0], r[1], r[2], r[3], r[4]) for r in rows]

    def release(self, *keys: str, attempt: int = 1) -> None:
        """Let the effects paused on ``keys`` at attempt ``attempt`` go on."""
        for key in keys:
            self._rows("INSERT INTO {schema}.releases VALUES (%s, %s) RETURNING key",
                       (key, attempt))

    def set_mode(self, mode: str) -> None:
        """Switch the provider 'up', 'down', '5xx' or 'timeout'."""
        self._rows("UPDATE {schema}.provider_mode SET mode = %s RETURNING mode", (mode,))
