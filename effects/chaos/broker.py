"""The NATS half of a chaos run: a real JetStream broker, its streams, and a consumer.

``nats.publish`` jobs publish to ``chaos.events.<key>``, one subject per job key, so the
stream itself counts the messages stored per key (``performed``). An ``InboxConsumer``
in the runner's process handles every message through the inbox, writing one row per
handling to ``<chaos>.consumed``; the checks then demand one message per done job and
one handling per message. The broker fault kills (or stops) the server and starts it
again on the same port and store, while dispatchers and the consumer are connected.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import nats
import nats.errors
from nats.js.api import RetentionPolicy, StreamConfig

import outbox
from effects._loop import LoopThread
from effects.nats import InboxConsumer, InboxEvent
from effects.testing import NatsServer

from ._sql import chaos_queries
from .schedule import EVENT_SUBJECTS, subject_for

__all__ = ["DEAD_STREAM", "STREAM", "ChaosBroker"]

log = logging.getLogger("effects.chaos")

STREAM = "CHAOS"
DEAD_STREAM = "CHAOS_DEAD"
_SUBJECTS = EVENT_SUBJECTS
_CONSUMER = "chaos-consumer"
_DUPLICATE_WINDOW = 600.0


async def _quiet(exc: Exception) -> None:
    """nats-py's default logs each failed reconnection with a traceback."""
    log.debug("broker connection error %s", type(exc).__name__)


class ChaosBroker:
    """A ``nats-server -js`` with the run's streams; ``performed(key)`` reads the stream.

    Thread-safe: the runner's threads (checks, kill judging, the fault injector) call it
    while the consumer runs on a thread of its own.
    """

    def __init__(self) -> None:
        self.server = NatsServer().start()
        self._loop = LoopThread("chaos-broker")
        self._client: Any = None
        self._lock = threading.Lock()
        self._consumer: InboxConsumer | None = None
        self._consumer_thread: threading.Thread | None = None
        self._stop_requested = threading.Event()
        self.consumer_errors: list[str] = []
        self.restart_seconds: list[float] = []
        try:
            self._call(self._add_streams())
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        """Where dispatchers publish."""
        return self.server.url

    # -- counting ----------------------------------------------------------------------

    def performed(self, key: str) -> int:
        """How many messages the stream holds for ``key`` (should be 0 or 1)."""
        return self.messages_per_key(subject_for(key)).get(key, 0)

    def messages_per_key(self, subjects: str = f"{_SUBJECTS}.>") -> dict[str, int]:
        """Messages stored per job key (for the keys under ``subjects``)."""
        counts: dict[str, int] = self._call(self._subject_counts(STREAM, subjects))
        prefix = _SUBJECTS + "."
        return {subject.removeprefix(prefix): n for subject, n in counts.items()}

    def performed_keys(self) -> list[str]:
        """Every key with a message in the stream."""
        return sorted(self.messages_per_key())

    def dead_letters(self) -> int:
        """Messages the consumer parked (it should park none: its handler never fails)."""
        return int(self._call(self._message_count(DEAD_STREAM)))

    # -- faults ------------------------------------------------------------------------

    def restart(self, variant: str, down: float) -> float:
        """Kill (``kill``) or stop gracefully (``stop``) the broker, keep it down for
        ``down`` seconds (the fault's length, so publishes meet it), start it again on
        the same port and store; return the seconds it was away."""
        started = time.monotonic()
        if variant == "kill":
            self.server.kill()
        else:
            self.server.stop()
        threading.Event().wait(down)
        self.server.start()
        took = time.monotonic() - started
        self.restart_seconds.append(took)
        return took

    # -- the consumer ------------------------------------------------------------------

    def start_consumer(self, dsn: str, schema: str, chaos: str) -> None:
        """Consume the stream into ``<chaos>.consumed`` through the inbox, on a thread."""
        insert = chaos_queries(schema, chaos).consumed_insert

        def handle(tx: outbox.Transaction, event: InboxEvent) -> None:
            tx.connection.execute(insert, {"message_id": event.message_id, "source": "nats",
                                           "subject": event.subject})

        self._consumer = InboxConsumer(
            dsn, handle, servers=self.url, stream=STREAM, name=_CONSUMER, schema=schema,
            subject=f"{_SUBJECTS}.>", max_deliver=20, backoff=(0.1, 0.5, 1.0), ack_wait=5.0,
            batch=64, dead_letter_subject=f"chaos.dead.{_CONSUMER}",
        )
        self._consumer_thread = threading.Thread(target=self._consume, name="chaos-consumer",
                                                 daemon=True)
        self._consumer_thread.start()

    def wait_consumed(self, timeout: float) -> bool:
        """Until the consumer has nothing pending or unacknowledged; False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self._call(self._consumer_idle()):
                    return True
            except Exception as exc:  # the broker may be coming back from a fault
                log.info("consumer state unavailable (%s)", type(exc).__name__)
            time.sleep(0.2)
        return False

    def stop_consumer(self) -> None:
        """Stop the consumer after the message in hand and join its thread."""
        self._stop_requested.set()
        if self._consumer is not None:
            self._consumer.stop()
        if self._consumer_thread is not None:
            self._consumer_thread.join(60.0)
            if self._consumer_thread.is_alive():
                self.consumer_errors.append("the consumer did not stop")
        self._consumer_thread = None

    @property
    def consumer_stats(self) -> dict[str, int]:
        """The consumer's counters: handled, duplicates (skipped by the inbox), failed,
        dead_lettered."""
        if self._consumer is None:
            return {}
        stats = self._consumer.stats
        return {"handled": stats.handled, "duplicates": stats.duplicates,
                "failed": stats.failed, "dead_lettered": stats.dead_lettered}

    def close(self) -> None:
        """Stop the consumer, the connection, the loop and the server."""
        self.stop_consumer()
        try:
            self._call(self._close_client())
        finally:
            self._loop.stop()
            self.server.close()

    def _consume(self) -> None:
        assert self._consumer is not None
        # The consumer reconnects to NATS by itself; a failure to (re)start it is
        # retried here so a broker fault at the wrong moment cannot end consumption.
        while not self._stop_requested.is_set():
            try:
                asyncio.run(self._consumer.run())
            except Exception as exc:
                log.warning("chaos consumer ended with %s; restarting it", type(exc).__name__,
                            exc_info=True)
                self.consumer_errors.append(type(exc).__name__)
                self._stop_requested.wait(0.5)

    # -- on the broker's loop ----------------------------------------------------------

    def _call(self, coroutine: Any) -> Any:
        with self._lock:
            return self._loop.call(coroutine, timeout=30.0)

    async def _js(self) -> Any:
        if self._client is None or self._client.is_closed:
            self._client = await nats.connect(self.url, max_reconnect_attempts=-1,
                                              reconnect_time_wait=0.2, connect_timeout=2,
                                              error_cb=_quiet)
        return self._client.jetstream()

    async def _add_streams(self) -> None:
        js = await self._js()
        await js.add_stream(StreamConfig(
            name=STREAM, subjects=[f"{_SUBJECTS}.>"], retention=RetentionPolicy.LIMITS,
            duplicate_window=_DUPLICATE_WINDOW))
        await js.add_stream(StreamConfig(
            name=DEAD_STREAM, subjects=["chaos.dead.>"], retention=RetentionPolicy.LIMITS,
            duplicate_window=_DUPLICATE_WINDOW))

    async def _subject_counts(self, stream: str, subjects: str) -> dict[str, int]:
        js = await self._js()
        info = await js.stream_info(stream, subjects_filter=subjects)
        return dict(info.state.subjects or {})

    async def _message_count(self, stream: str) -> int:
        js = await self._js()
        return int((await js.stream_info(stream)).state.messages)

    async def _consumer_idle(self) -> bool:
        js = await self._js()
        info = await js.consumer_info(STREAM, _CONSUMER)
        return bool(info.num_pending == 0 and info.num_ack_pending == 0)

    async def _close_client(self) -> None:
        if self._client is not None and not self._client.is_closed:
            await self._client.close()

