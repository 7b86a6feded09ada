"""One dispatcher process of a chaos run: ``python -m effects.chaos.worker``.

Its settings come as JSON in ``$OUTBOX_CHAOS_WORKER`` (the DSN may hold a password: not
on the command line). It runs ``outbox.Dispatcher.run()`` with the email, payment,
webhook, NATS and Kafka adapters pointed at the runner's fakes and brokers until SIGTERM, then
prints its ``DispatchStats`` as one JSON line on stdout. A worker killed with SIGKILL
prints nothing. Given several targets (``WorkerSettings.targets``) it runs one fleet
dispatcher, ``outbox.Dispatcher(effects=..., targets=[...])``, over them instead: its
engines are ``_ChaosDispatcher`` too, under the worker's tag.

Every adapter is wrapped in an audit: before the provider is called, the worker commits
``(key, claim_version, worker)`` (and the job's effect and group) to the ``deliveries``
table on a connection of its own, and afterwards the outcome. The runner reads it to find
double claims (one claim version delivered by two workers), to see which provider faults
reached the adapters and how many calls of a group were in flight at once.
"""

from __future__ import annotations

import asyncio
import faulthandler
import json
import logging
import os
import signal
import sys
import threading
import uuid
from collections.abc import Awaitable, Mapping
from typing import Any

import psycopg
from pydantic import BaseModel

import outbox
from effects.email import SendEmail
from effects.kafka import Produce
from effects.nats import PublishEvent
from effects.payments import ChargeCard
from effects.webhook import PostWebhook
from outbox import Effect, Job, Limit, Retry
from outbox.effect import is_async_effect

from ._sql import chaos_queries
from .settings import ENV_VARIABLE, WorkerSettings, application_name

__all__ = ["FAKE_API_KEY", "AuditLog", "audited", "main", "run"]

FAKE_API_KEY = "chaos_test_key"
_MAX_OUTCOME = 500
# Longer than a broker fault lasts (so a produce waits it out), short enough that a
# delivery report that never comes ends as UnknownOutcome within the run.
_KAFKA_DELIVERY_TIMEOUT = 5.0

log = logging.getLogger("effects.chaos.worker")


class AuditLog:
    """The worker's record of every provider call, on one autocommit connection shared
    by the worker threads (a lock; each statement takes well under a millisecond).

    ``begin`` must land before the provider is called: if the database cannot be
    reached it raises ``Retry``, so nothing is sent unaudited. ``end`` is best effort.
    """

    def __init__(self, dsn: str, schema: str, chaos: str, worker: str) -> None:
        self._dsn = dsn
        self._queries = chaos_queries(schema, chaos)
        self._worker = worker
        self._lock = threading.Lock()
        self._conn: psycopg.Connection[Any] | None = None

    def begin(self, job: Job) -> str:
        """Record that ``job`` is about to reach its provider; return the call's id."""
        call_id = str(uuid.uuid4())
        params = {"call_id": call_id, "key": job.key, "claim_version": job.claim_version,
                  "worker": self._worker, "attempt": job.attempt, "effect": job.effect,
                  "group_key": job.group}
        if not self._execute(self._queries.delivery_begin, params):
            raise Retry(f"chaos audit unavailable for job {job.key}; nothing sent", after=0.2)
        return call_id

    def end(self, call_id: str, outcome: str) -> None:
        """Record how the call ended (``ok`` or the exception); lost if the database is
        unreachable right now, which only makes the fault counts conservative."""
        self._execute(self._queries.delivery_end,
                      {"call_id": call_id, "outcome": outcome[:_MAX_OUTCOME]})

    def close(self) -> None:
        """Close the connection."""
        with self._lock:
            self._discard()

    def _execute(self, query: str, params: Mapping[str, Any]) -> bool:
        with self._lock:
            for _ in range(2):  # the connection may be stale after a restart: once more
                try:
                    self._connection().execute(query, params)
                    return True
                except psycopg.OperationalError as exc:
                    log.info("audit connection lost (%s)", type(exc).__name__)
                    self._discard()
            return False

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self._dsn, autocommit=True, connect_timeout=5,
                                         application_name=f"chaos audit {self._worker}"[:63])
        return self._conn

    def _discard(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._conn = None


class _Audited(Effect):
    """An adapter whose every call is recorded in the audit before and after."""

    def __init__(self, inner: Effect, audit: AuditLog) -> None:
        self._inner = inner
        self._audit = audit

    def perform(self, job: Job) -> Mapping[str, Any] | BaseModel | Awaitable[Any] | None:
        """Record the call, perform it with the wrapped adapter, record the outcome."""
        call_id = self._audit.begin(job)
        try:
            result = self._inner.perform(job)
        except Exception as exc:
            self._audit.end(call_id, f"{type(exc).__name__}: {exc}")
            raise
        self._audit.end(call_id, "ok")
        return result


class _AuditedAsync(_Audited):
    """The audit around an adapter whose ``perform`` is a coroutine function."""

    async def perform(self, job: Job) -> Any:
        """Record the call, await the wrapped adapter, record the outcome."""
        call_id = await asyncio.to_thread(self._audit.begin, job)
        try:
            result = await self._inner.perform(job)  # type: ignore[misc]
        except Exception as exc:
            await asyncio.to_thread(self._audit.end, call_id, f"{type(exc).__name__}: {exc}")
            raise
        await asyncio.to_thread(self._audit.end, call_id, "ok")
        return result


def audited(inner: Effect, audit: AuditLog) -> Effect:
    """``inner`` wrapped in the audit, under the same effect name and payload model."""
    base = _AuditedAsync if is_async_effect(inner) else _Audited

    class Audited(base):  # type: ignore[valid-type,misc]
        name = inner.name
        payload_model = inner.payload_model

    return Audited(inner, audit)


class _ChaosDispatcher(outbox.Dispatcher):
    """A Dispatcher whose connections carry the worker's tag in ``application_name``
    ("outbox claimer <tag>"), so the runner can tell one worker's backends from
    another's: to aim a kill at a claim or a completion in flight, and to terminate
    one worker's connections. Everything else is the shipped Dispatcher."""

    def _connect(self, role: str) -> psycopg.Connection[Any]:
        conn = super()._connect(role)
        conn.execute("SELECT set_config('application_name', %s, false)",
                     (application_name(role, self.worker_id),))
        return conn


def _adapters(settings: WorkerSettings) -> list[Effect]:
    timeout = settings.provider_timeout
    return [
        SendEmail(api_key=FAKE_API_KEY, base_url=settings.email_url, timeout=timeout),
        ChargeCard(api_key=FAKE_API_KEY, base_url=settings.stripe_url, timeout=timeout),
        PostWebhook(url=settings.webhook_url, secret=settings.webhook_secret, timeout=timeout),
        PublishEvent(settings.nats_url, settings.nats_stream, timeout=timeout,
                     lease=settings.lease, rescue_interval=settings.rescue_interval),
        Produce(settings.kafka_bootstrap, delivery_timeout=_KAFKA_DELIVERY_TIMEOUT,
                connect_timeout=timeout * 2,
                # back within half a second of a broker's return, not librdkafka's 10 s
                config={"reconnect.backoff.max.ms": 500}),
    ]


def _dispatcher(settings: WorkerSettings, effects: list[Effect]) -> _ChaosDispatcher:
    """The worker's dispatcher: of ``settings.schema`` alone, or a fleet of the targets."""
    options: dict[str, Any] = {
        "concurrency": settings.concurrency, "lease": settings.lease,
        "rescue_interval": settings.rescue_interval, "poll_interval": 0.5,
        "backoff": outbox.Backoff(base=settings.backoff_base, cap=settings.backoff_cap),
        "retention": None, "ledger_retention": None, "worker_id": settings.tag,
        "stop_timeout": settings.stop_timeout,
        "limits": {effect: Limit(**fields) for effect, fields in settings.limits.items()},
    }
    if settings.wait_for_replicas:
        options["wait_for_replicas"] = True
    if settings.targets:
        return _ChaosDispatcher(
            effects=effects,
            targets=[outbox.Target(settings.dsn, schema) for schema in settings.targets],
            **options)
    return _ChaosDispatcher(settings.dsn, effects, schema=settings.schema, **options)


def _announce_ready(dispatcher: outbox.Dispatcher, ready_file: str) -> None:
    """Make SIGTERM stop ``dispatcher`` from now on, then write ``ready_file``: the
    runner may stop the worker as soon as it sees the file. ``run()`` installs its own
    handler; one that lands before it makes ``run()`` return at once."""

    def handler(signum: int, frame: Any) -> None:
        # stop() takes locks the interrupted thread may hold: from a thread of its own
        threading.Thread(target=dispatcher.stop, name="chaos-stop", daemon=True).start()

    signal.signal(signal.SIGTERM, handler)
    with open(ready_file, "w", encoding="utf-8") as marker:
        marker.write(f"{os.getpid()}\n")


def run(settings: WorkerSettings) -> dict[str, int | float]:
    """Dispatch until SIGTERM; return the dispatcher's counters."""
    audit = AuditLog(settings.dsn, settings.view or settings.schema, settings.chaos,
                     settings.tag)
    adapters = _adapters(settings)
    try:
        dispatcher = _dispatcher(settings, [audited(a, audit) for a in adapters])
        if settings.ready_file:
            _announce_ready(dispatcher, settings.ready_file)
        return dispatcher.run().as_dict()
    finally:
        for adapter in adapters:
            close = getattr(adapter, "close", None)
            if callable(close):
                close()
        audit.close()


def main() -> None:
    """Entry point of the worker process."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("stripe").setLevel(logging.ERROR)
    # The runner sends SIGUSR1 to a worker that does not stop: every thread's stack
    # goes to the log before it is killed.
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    settings = WorkerSettings.from_json(os.environ[ENV_VARIABLE])
    stats = run(settings)
    sys.stdout.write(json.dumps(stats) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
