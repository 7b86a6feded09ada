"""``kafka.produce``: produce an event to a Kafka topic, at least once per job; and
``InboxConsumer``, which handles each message exactly once into PostgreSQL (see
``effects._kafka_consumer``).

The payload is ``{"topic": ..., "key": ..., "value": <any JSON>, "headers": {...}}``
(``key`` and ``headers`` optional). The message value is the canonical JSON of
``value`` (compact, keys sorted), so every attempt produces the same bytes; its key is
``key``, else the job's ordering key (so the events of one ordering key land on one
partition, in order), else none. Headers::

    outbox-key          the job's key: consumers deduplicate on it (an inbox)
    outbox-event-time   when the job was first attempted (RFC 3339, UTC)
    ...                 the payload's own headers

The ledger result is ``{"topic", "partition", "offset"}`` of the acknowledged message.
``offset`` is null when the broker acknowledged a retried request as a duplicate of a
message it had already stored (the idempotent producer retrying after a lost response):
the message is stored once, at an offset the broker does not report.

Kafka has no broker-side deduplication by our key. The producer is idempotent
(``enable.idempotence``), which only removes the duplicates of its own internal retries
within one producer session. A worker that dies after the broker acknowledged and before
``done`` is recorded makes the job run again, and the message is produced a second time
with the same ``outbox-key``: consumers must deduplicate, e.g. through the inbox
(``tx.receive(consumer, headers["outbox-key"])``).

Outcome of an attempt, by what happened::

    acknowledged by the partition leader (acks=all)      done
    payload invalid (topic, headers, NaN in value)       Permanent, nothing produced
    message too large, unknown topic or partition,       Permanent, with the reason
      not authorised
    no broker reachable (checked before producing)       Retry: nothing was sent
    local queue full                                     Retry: nothing was sent
    delivery failed after the message was handed to      UnknownOutcome: the broker may
      the client (timed out, connection lost)              have stored it; produced again
    no delivery report within the delivery timeout       UnknownOutcome
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Mapping
from datetime import UTC
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer
from pydantic import BaseModel, ConfigDict, Field, JsonValue, field_validator

from outbox import Effect, EffectOutcome, Job, Permanent, Retry, UnknownOutcome

from ._cloudevents import Envelope, attributes, check_envelope
from ._kafka_consumer import InboxConsumer, KafkaConsumerStats, KafkaEvent
from ._payload import stop_if_told, validated_payload

__all__ = ["KEY_HEADER", "InboxConsumer", "KafkaConsumerStats", "KafkaEvent", "Produce",
           "ProducePayload"]

log = logging.getLogger("effects.kafka")

KEY_HEADER = "outbox-key"
EVENT_TIME_HEADER = "outbox-event-time"
_RESERVED_PREFIXES = ("outbox-", "ce_")
_MAX_TOPIC = 249  # Kafka's own limit
_TOPIC_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
_PERMANENT = {
    KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.INVALID_MSG_SIZE,
    KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC, KafkaError._UNKNOWN_PARTITION,
    KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.TOPIC_EXCEPTION,
    KafkaError.RECORD_LIST_TOO_LARGE, KafkaError._INVALID_ARG,
}
_NOT_SENT = {KafkaError._QUEUE_FULL}
# The canonical JSON of effects.nats.canonical_json (compact, keys sorted, no NaN), with
# its encoder built once instead of on every call.
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                              allow_nan=False)


class ProducePayload(BaseModel):
    """A ``kafka.produce`` payload: ``topic``, ``value`` (any JSON), optional ``key``
    and ``headers``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    topic: str = Field(min_length=1, max_length=_MAX_TOPIC)
    key: str | None = None
    value: JsonValue
    headers: dict[str, str] = Field(default_factory=dict, max_length=64)
    # The CloudEvents type with envelope="cloudevents" (default: the topic).
    type: str | None = Field(default=None, min_length=1, max_length=255)

    @field_validator("topic")
    @classmethod
    def _valid_topic(cls, topic: str) -> str:
        if not set(topic) <= _TOPIC_CHARS or topic in (".", ".."):
            raise ValueError("must be a Kafka topic name: ASCII letters, digits, '.', '_', '-'")
        return topic

    @field_validator("headers")
    @classmethod
    def _valid_headers(cls, headers: dict[str, str]) -> dict[str, str]:
        for name in headers:
            if not name or name.lower().startswith(_RESERVED_PREFIXES):
                raise ValueError(f"header {name!r} is empty or reserved (outbox-* and ce_* "
                                 "are set here)")
        return headers


class Produce(Effect):
    """Produces ``kafka.produce`` jobs to Kafka with an idempotent producer.

    Guarantee: at least once per job, every attempt with the same value bytes, message
    key and ``outbox-key`` header (see the module docstring: Kafka does not deduplicate
    by our key, consumers do). ``bootstrap_servers`` names the cluster
    (``host:port,...``); ``config`` adds librdkafka settings (security, ``linger.ms`` ...)
    but cannot turn idempotence or ``acks=all`` off. ``delivery_timeout`` (seconds) bounds
    how long a message may wait for its acknowledgement.

    ``perform`` awaits the delivery report of its own message; messages from concurrent
    jobs are in flight together on the one producer, whose reports are served by a
    thread of its own and handed to the awaiting event loop in one batch per poll (one
    wake-up of the loop for many reports, no timer per message: the same thread fails
    a message whose report is overdue). ``close()`` flushes and stops it. Reasons and
    logs carry the job key and the topic, never the value. With
    ``envelope="cloudevents"`` each message is also a CloudEvent in Kafka's binary mode
    (``ce_id`` = the job key, ``ce_source`` = ``source``, ``ce_type`` = the payload's
    ``type`` or the topic, ``ce_time`` = the first attempt, ``content-type``; see
    ``effects._cloudevents``).
    """

    name = "kafka.produce"
    payload_model = ProducePayload

    def __init__(
        self,
        bootstrap_servers: str = "127.0.0.1:9092",
        *,
        config: Mapping[str, Any] | None = None,
        delivery_timeout: float = 30.0,
        connect_timeout: float = 5.0,
        envelope: Envelope = None,
        source: str = "/outbox",
    ) -> None:
        """
        :param bootstrap_servers: The cluster's brokers, ``host:port,...``.
        :param config: librdkafka settings added to the producer's (security,
            ``linger.ms`` ...); idempotence and ``acks=all`` stay on.
        :param delivery_timeout: Seconds a message may wait for its acknowledgement.
        :param connect_timeout: Seconds a broker has to answer before a produce after a
            start or a transport failure (else the job is retried, nothing sent).
        :param envelope: None for the value as it is, or ``"cloudevents"`` for a
            CloudEvent in Kafka's binary mode.
        :param source: The CloudEvents ``source`` attribute, with that envelope.
        """
        if not delivery_timeout > 0 or not connect_timeout > 0:
            raise ValueError("delivery_timeout and connect_timeout must be positive")
        check_envelope(envelope, source)
        self.envelope, self.source = envelope, source
        settings: dict[str, Any] = {"bootstrap.servers": bootstrap_servers, **(config or {})}
        settings.update({
            "enable.idempotence": True, "acks": "all",
            "message.timeout.ms": int(delivery_timeout * 1000),
        })
        self._settings = settings
        self.delivery_timeout = delivery_timeout
        self.connect_timeout = connect_timeout
        self._producer: Producer | None = None
        self._lock = threading.Lock()
        self._poller: threading.Thread | None = None
        # Delivery reports served by the current poll, settled on their loops after it.
        self._reports: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[Message],
                                  KafkaError | None, Message]] = []
        # (deadline, loop, future) of each message handed over, in deadline order (one
        # timeout for all): the poll thread fails those whose report is overdue.
        self._awaited: deque[tuple[float, asyncio.AbstractEventLoop,
                                   asyncio.Future[Message]]] = deque()
        self._closing = threading.Event()
        self._reachable = False  # a broker answered since the last transport failure
        self._checking = threading.Lock()

    # -- the effect -----------------------------------------------------------------

    async def perform(self, job: Job) -> dict[str, Any]:
        """Produce the job's message; return ``{"topic", "partition", "offset"}``.

        Raises ``Retry``, ``Permanent`` or ``UnknownOutcome`` as drawn in the module
        docstring. Validation happens before any network call.
        """
        event = validated_payload(ProducePayload, job)
        what = f"kafka.produce job {job.key} to topic {event.topic}"
        try:
            value = _CANONICAL.encode(event.value).encode()
        except ValueError as exc:
            raise Permanent(f"{what}: value: not JSON (NaN or infinity)") from exc
        key = event.key if event.key is not None else job.ordering_key
        producer = self._get()
        if not self._reachable:
            await asyncio.to_thread(self._check_reachable, producer, what)
        loop = asyncio.get_running_loop()
        delivered: asyncio.Future[Message] = loop.create_future()

        def report(error: KafkaError | None, message: Message) -> None:  # the poll thread
            self._reports.append((loop, delivered, error, message))  # the list of now

        stop_if_told(job, what)
        try:
            producer.produce(event.topic, value, key=None if key is None else key.encode(),
                             headers=self._headers(job, event), on_delivery=report)
        except KafkaException as exc:
            raise _outcome(exc.args[0], what, sent=False) from exc
        except BufferError as exc:
            raise Retry(f"{what}: the producer's local queue is full; nothing sent") from exc
        # librdkafka reports every message by its message.timeout.ms; the margin covers
        # a report that never comes all the same.
        self._awaited.append((time.monotonic() + self.delivery_timeout + 5.0, loop, delivered))
        try:
            message = await delivered
        except TimeoutError as exc:
            raise UnknownOutcome(f"{what}: no delivery report within "
                                 f"{self.delivery_timeout:g} s; it may have been stored") from exc
        except KafkaException as exc:
            outcome = _outcome(exc.args[0], what, sent=True)
            if isinstance(outcome, UnknownOutcome):
                self._reachable = False  # check for a broker before the next one
            raise outcome from exc
        return {"topic": message.topic(), "partition": message.partition(),
                "offset": message.offset()}

    def close(self) -> None:
        """Deliver what is in flight (up to the delivery timeout), then stop."""
        with self._lock:
            producer, self._producer = self._producer, None
            poller, self._poller = self._poller, None
        self._closing.set()
        if poller is not None:
            poller.join()
        if producer is not None:
            producer.flush(self.delivery_timeout)
            self._hand_over()

    def __enter__(self) -> Produce:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Produce(bootstrap_servers={self._settings['bootstrap.servers']!r})"

    # -- the producer -----------------------------------------------------------------

    def _get(self) -> Producer:
        with self._lock:
            if self._producer is None:
                self._closing.clear()
                self._producer = Producer(self._settings, logger=log)
                self._poller = threading.Thread(target=self._poll, args=(self._producer,),
                                                name="kafka.produce", daemon=True)
                self._poller.start()
            return self._producer

    def _poll(self, producer: Producer) -> None:
        """Serve delivery reports until closed; fail the overdue ones."""
        while not self._closing.is_set():
            producer.poll(0.05)
            self._hand_over()
            self._expire(time.monotonic())

    def _hand_over(self) -> None:
        """Settle the reports the last poll (or flush) served: one call into each
        awaiting loop for the lot."""
        if not self._reports:
            return
        # The callbacks append in this thread only (poll and flush run them), so the
        # list is swapped, not locked.
        reports, self._reports = self._reports, []
        by_loop: dict[asyncio.AbstractEventLoop, list[Any]] = {}
        for loop, delivered, error, message in reports:
            by_loop.setdefault(loop, []).append((delivered, error, message))
        for loop, settled in by_loop.items():
            try:
                loop.call_soon_threadsafe(_settle_all, settled)
            except RuntimeError:  # that loop is closed: nobody awaits these any more
                log.debug("kafka.produce: %d delivery reports for a closed loop", len(settled))

    def _expire(self, now: float) -> None:
        """Fail (with TimeoutError, on their loops) the messages whose report is overdue;
        forget those settled."""
        awaited = self._awaited
        while awaited and (awaited[0][2].done() or awaited[0][0] <= now):
            _, loop, delivered = awaited.popleft()
            if not delivered.done():
                with contextlib.suppress(RuntimeError):  # a closed loop: nobody awaits
                    loop.call_soon_threadsafe(_overdue, delivered)

    def _check_reachable(self, producer: Producer, what: str) -> None:
        """Before producing after a start or a transport failure: a broker must answer,
        else the job is retried with nothing sent."""
        with self._checking:  # one check at a time; the others take its answer
            if self._reachable:
                return
            try:
                producer.list_topics(timeout=self.connect_timeout)
            except KafkaException as exc:
                raise Retry(f"{what}: no Kafka broker reachable ({exc.args[0].name()}); "
                            "nothing sent") from exc
            self._reachable = True

    def _headers(self, job: Job, event: ProducePayload) -> list[tuple[str, str | bytes | None]]:
        headers: list[tuple[str, str | bytes | None]] = [
            (name, value.encode()) for name, value in event.headers.items()]
        headers.append((KEY_HEADER, job.key.encode()))
        if job.first_attempted_at is not None:
            stamp = job.first_attempted_at.astimezone(UTC).isoformat(timespec="microseconds")
            headers.append((EVENT_TIME_HEADER, stamp.encode()))
        if self.envelope == "cloudevents":
            headers.append(("content-type", b"application/json"))
            headers.extend((name, value.encode()) for name, value in attributes(
                job, source=self.source, type_=event.type or event.topic, prefix="ce_").items())
        return headers


def _settle_all(settled: list[tuple[asyncio.Future[Message], KafkaError | None, Message]],
                ) -> None:
    """On the awaiting loop: each future its delivery report (a future already done,
    failed as overdue or cancelled, is left as it is)."""
    for delivered, error, message in settled:
        if delivered.done():
            continue
        if error is None:
            delivered.set_result(message)
        else:
            delivered.set_exception(KafkaException(error))


def _overdue(delivered: asyncio.Future[Message]) -> None:
    if not delivered.done():
        delivered.set_exception(TimeoutError())


def _outcome(error: KafkaError, what: str, *, sent: bool) -> EffectOutcome:
    """The one place librdkafka's errors become outcomes (see the module table)."""
    detail = f"{what}: {error.name()} ({error.str()})"
    if error.code() in _PERMANENT:
        return Permanent(detail + "; nothing stored")
    if not sent or error.code() in _NOT_SENT:
        return Retry(detail + "; nothing sent")
    return UnknownOutcome(detail + "; the broker may have stored it")
