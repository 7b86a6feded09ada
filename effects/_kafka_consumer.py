"""``InboxConsumer`` for Kafka: each message's handling and its partition's offset commit
together in PostgreSQL, so a message is processed exactly once into the database.

For each batch (up to ``batch`` messages from ``consume``)::

    open one database transaction
      tx.receive_many(group, ids)       which messages are new (by outbox-key)
      handler(tx, event)                for each new one, in partition order
      store each partition's next offset       <schema>.kafka_offsets
    commit
    commit the offsets to Kafka too     (for lag monitoring only; never read back)

On every partition assignment the consumer seeks to the offset stored in PostgreSQL (a
partition never stored starts from the group's Kafka offset, else ``auto.offset.reset``,
``earliest`` by default). A consumer killed after the database commit resumes after what
it committed, whether or not Kafka heard of the offsets; the inbox also recognises a
message produced twice (a producer that died between the broker's ack and ``done``
produces again with the same ``outbox-key``).

A handler that raises rolls the batch back; the batch is then handled again with a
savepoint around each message, and what precedes the failed message on its partition
commits. The failed message's partition is sought back to it and retried after a delay
(``backoff``); on its ``max_attempts``-th failure it is produced to
``dead_letter_topic`` (default ``<topic>.dlq``) with the reason in headers and skipped,
its offset stored past it; if that produce fails, it is retried later: nothing is
dropped. Other partitions go on meanwhile. A database that cannot be reached is waited
for (the batch is read again from the stored offsets).

The message id is the ``outbox-key`` header (the producing job's key), else
``<topic>:<partition>:<offset>``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from confluent_kafka import OFFSET_INVALID, Consumer, KafkaError, Message, Producer, TopicPartition

import outbox
from outbox.sql import queries

from ._consumer_stats import ConsumerStats

__all__ = ["InboxConsumer", "KafkaConsumerStats", "KafkaEvent"]

log = logging.getLogger("effects.kafka.consumer")

KEY_HEADER = "outbox-key"
Handler = Callable[["outbox.Transaction", "KafkaEvent"], object]
_RECONNECT_PAUSE = 0.5
PARKED = "parked"  # a message's result: produced to the dead-letter topic and skipped
Result = bool | Exception | str | None  # None: not handled, read again


@dataclass(frozen=True)
class KafkaEvent:
    """One message as the handler sees it (``json()`` parses the value)."""

    message_id: str
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    headers: Mapping[str, bytes]

    def json(self) -> Any:
        """The value parsed as JSON (raises ``ValueError`` if it is not JSON)."""
        return json.loads(self.value)


# The same counters as the NATS consumer's, under the name this module has exported.
KafkaConsumerStats = ConsumerStats


class InboxConsumer:
    """Consumes ``topics`` as the consumer group ``group``; see the module docstring.

    Guarantee: ``handler(tx, event)`` commits exactly once per message (with the inbox
    row and the partition's next offset, in one transaction on this consumer's own
    connection), in partition order; a message failing ``max_attempts`` times is parked
    on the dead-letter topic, never looped. ``group`` is both the Kafka consumer group
    and the inbox's consumer name. ``config`` adds librdkafka settings (security ...).
    ``run()`` blocks the calling thread until ``stop()`` (safe from any thread).
    """

    def __init__(
        self,
        conninfo: str,
        handler: Handler,
        *,
        bootstrap_servers: str,
        topics: Sequence[str],
        group: str,
        schema: str = "outbox",
        batch: int = 500,
        max_attempts: int = 5,
        backoff: Sequence[float] = (1.0, 5.0, 30.0),
        dead_letter_topic: Callable[[str], str] | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        """
        :param conninfo: The database's connection string (the inbox and your tables).
        :param handler: ``handler(tx, event)``, run once per message.
        :param bootstrap_servers: The cluster's brokers, ``host:port,...``.
        :param topics: The topics to consume.
        :param group: The Kafka consumer group, also the inbox's consumer name.
        :param schema: The schema holding the outbox tables (the inbox among them).
        :param batch: The most messages handled in one transaction.
        :param max_attempts: Attempts at a failing message before it is parked on the
            dead-letter topic.
        :param backoff: Seconds before the n-th new attempt at a failed message (the last
            value repeats).
        :param dead_letter_topic: A function of a topic naming its dead-letter topic;
            None: ``<topic>.dlq``.
        :param config: librdkafka settings added to the consumer's (security ...).
        """
        if not topics or batch < 1 or max_attempts < 1 or not backoff:
            raise ValueError("topics, batch >= 1, max_attempts >= 1 and backoff are needed")
        self._conninfo = conninfo
        self._handler = handler
        self.topics = list(topics)
        self.group = group
        self.schema = schema
        self.batch = batch
        self.max_attempts = max_attempts
        self.backoff = tuple(backoff)
        self.dead_letter_topic = dead_letter_topic or (lambda topic: f"{topic}.dlq")
        self._settings: dict[str, Any] = {
            "bootstrap.servers": bootstrap_servers, "auto.offset.reset": "earliest",
            **(config or {}),
            "group.id": group, "enable.auto.commit": False, "enable.partition.eof": True,
        }
        self._queries = queries(schema)
        self._db: psycopg.Connection[Any] | None = None
        self._producer: Producer | None = None
        self._stopping = threading.Event()
        self._attempts: dict[tuple[str, int, int], int] = {}
        self._paused_until: dict[tuple[str, int], float] = {}
        self._at_end: set[tuple[str, int]] = set()
        self._assigned: set[tuple[str, int]] = set()
        self.stats = KafkaConsumerStats()

    # -- running ---------------------------------------------------------------------

    def run(self) -> KafkaConsumerStats:
        """Consume until ``stop()``."""
        return self._consume(idle_timeout=None)

    def run_until_idle(self, idle_timeout: float = 1.0) -> KafkaConsumerStats:
        """Consume until every assigned partition is read to its end and nothing came
        for ``idle_timeout`` seconds (for tests and batch jobs)."""
        return self._consume(idle_timeout=idle_timeout)

    def stop(self) -> None:
        """Ask ``run`` to return after the batch in hand; safe from any thread, before or
        during a run (a stop before ``run()`` makes it return at once)."""
        self._stopping.set()

    def _consume(self, idle_timeout: float | None) -> KafkaConsumerStats:
        try:
            if self._stopping.is_set():
                return self.stats
            return self._consume_until_stopped(idle_timeout)
        finally:
            self._stopping.clear()  # honoured: the next run starts afresh

    def _consume_until_stopped(self, idle_timeout: float | None) -> KafkaConsumerStats:
        consumer = Consumer(self._settings, logger=log)
        consumer.subscribe(self.topics, on_assign=self._on_assign, on_revoke=self._on_revoke)
        quiet_since = time.monotonic()
        try:
            while not self._stopping.is_set():
                self._resume_due(consumer)
                messages = consumer.consume(self.batch, timeout=0.2)
                real = [m for m in messages if self._usable(m)]
                if real:
                    quiet_since = time.monotonic()
                    self._process(consumer, real)
                elif idle_timeout is not None and self._idle(quiet_since, idle_timeout):
                    break
        finally:
            consumer.close()
            self._close_db()
            if self._producer is not None:
                self._producer.flush(10)
        return self.stats

    def _usable(self, message: Message) -> bool:
        error = message.error()
        if error is None:
            self._at_end.discard((message.topic() or "", message.partition() or 0))
            return True
        if error.code() == KafkaError._PARTITION_EOF:
            self._at_end.add((message.topic() or "", message.partition() or 0))
        else:
            log.info("%s: consumer error %s", self.group, error.name())
        return False

    def _idle(self, quiet_since: float, idle_timeout: float) -> bool:
        return (bool(self._assigned) and self._assigned <= self._at_end
                and not self._paused_until
                and time.monotonic() - quiet_since >= idle_timeout)

    # -- assignment: seek to what PostgreSQL committed ---------------------------------

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        stored = self._stored_offsets()
        for tp in partitions:
            offset = stored.get((tp.topic, tp.partition))
            if offset is not None:
                tp.offset = offset
            self._assigned.add((tp.topic, tp.partition))
        consumer.assign(partitions)

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        for tp in partitions:
            self._assigned.discard((tp.topic, tp.partition))
            self._at_end.discard((tp.topic, tp.partition))
            self._paused_until.pop((tp.topic, tp.partition), None)

    def _stored_offsets(self) -> dict[tuple[str, int], int]:
        while True:
            try:
                rows = self._connection().execute(self._queries.kafka_offsets, {
                    "consumer": self.group, "topics": self.topics}).fetchall()
                return {(str(t), int(p)): int(o) for t, p, o in rows}
            except psycopg.OperationalError as exc:
                log.warning("%s: cannot read stored offsets (%s); retrying", self.group,
                            type(exc).__name__)
                self._close_db()
                time.sleep(_RECONNECT_PAUSE)

    # -- one batch ---------------------------------------------------------------------

    def _process(self, consumer: Consumer, messages: list[Message]) -> None:
        events = [_event(m) for m in messages]
        try:
            results = self._handle(events)
        except psycopg.OperationalError as exc:
            log.warning("%s: database unreachable (%s); reading the batch again",
                        self.group, type(exc).__name__)
            self._close_db()
            self._rewind(consumer, events, None)
            time.sleep(_RECONNECT_PAUSE)
            return
        failed: dict[tuple[str, int], tuple[KafkaEvent, Exception]] = {}
        for event, result in zip(events, results, strict=True):
            if result is True:
                self.stats.handled += 1
                self._attempts.pop((event.topic, event.partition, event.offset), None)
            elif result is False:
                self.stats.duplicates += 1
            elif isinstance(result, Exception):
                failed.setdefault((event.topic, event.partition), (event, result))
        if failed:
            self._rewind(consumer, events, failed)
        if offsets := self._next_offsets(events, failed):
            consumer.commit(offsets=offsets, asynchronous=True)  # for lag monitoring only

    def _handle(self, events: list[KafkaEvent]) -> list[Result]:
        """The batch in one transaction with its offsets; on a handler's error, again
        with a savepoint per message, stopping each partition at its failed message."""
        db = self._connection()
        failure: dict[int, Exception] = {}
        try:
            with db.transaction():
                tx = outbox.Transaction(db, schema=self.schema)
                first = tx.receive_many(self.group, [e.message_id for e in events])
                for index, (event, new) in enumerate(zip(events, first, strict=True)):
                    if new:
                        try:
                            self._handler(tx, event)
                        except Exception as exc:
                            failure[index] = exc
                            raise
                self._store(db, self._next_offsets(events, {}))
            return list(first)
        except psycopg.OperationalError:
            raise
        except Exception as exc:
            log.info("%s: a handler failed in a batch of %d (%s); handling each message "
                     "under a savepoint", self.group, len(events), type(exc).__name__)
        results: list[Result] = []
        stopped: dict[tuple[str, int], tuple[KafkaEvent, Exception]] = {}
        with db.transaction():
            for index, event in enumerate(events):
                where = (event.topic, event.partition)
                if where in stopped:
                    results.append(None)  # after a failure on its partition: read again
                    continue
                result: Result = failure.get(index) or self._handle_one(db, event)
                if isinstance(result, Exception):
                    if self._park(event, result):
                        result = PARKED
                    else:
                        stopped[where] = (event, result)
                results.append(result)
            self._store(db, self._next_offsets(events, stopped))
        return results

    def _handle_one(self, db: psycopg.Connection[Any], event: KafkaEvent) -> bool | Exception:
        try:
            with outbox.transaction(db, schema=self.schema) as tx:  # a savepoint
                if not tx.receive(self.group, event.message_id):
                    return False
                self._handler(tx, event)
            return True
        except psycopg.OperationalError:
            raise
        except Exception as exc:
            return exc

    def _park(self, event: KafkaEvent, exc: Exception) -> bool:
        """Count a failure; at ``max_attempts``, produce the message to the dead-letter
        topic. True once parked (its offset may move past it)."""
        where = (event.topic, event.partition, event.offset)
        attempts = self._attempts[where] = self._attempts.get(where, 0) + 1
        self.stats.failed += 1
        self.stats.errors.append(type(exc).__name__)
        log.warning("%s: message %s failed on attempt %d (%s)", self.group, event.message_id,
                    attempts, type(exc).__name__)
        if attempts < self.max_attempts:
            return False
        topic = self.dead_letter_topic(event.topic)
        headers = {**event.headers, "outbox-dead-letter-reason": type(exc).__name__.encode(),
                   "outbox-original-topic": event.topic.encode(),
                   "outbox-original-partition": str(event.partition).encode(),
                   "outbox-original-offset": str(event.offset).encode(),
                   KEY_HEADER: event.message_id.encode()}
        try:
            producer = self._dead_letters()
            producer.produce(topic, event.value, key=event.key, headers=list(headers.items()))
            if producer.flush(10) != 0:
                raise TimeoutError("the dead-letter message was not acknowledged")
        except Exception as error:
            log.error("%s: message %s could not be parked on %s (%s); kept for a retry",
                      self.group, event.message_id, topic, type(error).__name__)
            return False
        log.error("%s: message %s parked on %s after %d attempts", self.group,
                  event.message_id, topic, attempts)
        self.stats.dead_lettered += 1
        del self._attempts[where]
        return True

    def _rewind(self, consumer: Consumer, events: list[KafkaEvent],
                failed: dict[tuple[str, int], tuple[KafkaEvent, Exception]] | None) -> None:
        """Seek each partition back to its first message not committed (all of them
        when ``failed`` is None), pausing a failed one for its backoff."""
        firsts: dict[tuple[str, int], KafkaEvent] = {}
        for event in events:
            firsts.setdefault((event.topic, event.partition), event)
        targets = firsts if failed is None else {w: e for w, (e, _) in failed.items()}
        for (topic, partition), event in targets.items():
            consumer.seek(TopicPartition(topic, partition, event.offset))
            if failed is not None:
                attempts = self._attempts.get((topic, partition, event.offset), 1)
                delay = self.backoff[min(attempts, len(self.backoff)) - 1]
                consumer.pause([TopicPartition(topic, partition)])
                self._paused_until[(topic, partition)] = time.monotonic() + delay

    def _resume_due(self, consumer: Consumer) -> None:
        now = time.monotonic()
        for where, until in list(self._paused_until.items()):
            if until <= now:
                del self._paused_until[where]
                consumer.resume([TopicPartition(*where)])

    def _next_offsets(self, events: list[KafkaEvent],
                      stopped: Mapping[tuple[str, int], tuple[KafkaEvent, Exception]],
                      ) -> list[TopicPartition]:
        """Per partition: the offset after its last committed message (a stopped
        partition's failed message is the next to read)."""
        offsets: dict[tuple[str, int], int] = {}
        for event in events:
            where = (event.topic, event.partition)
            offsets[where] = stopped[where][0].offset if where in stopped else event.offset + 1
        return [TopicPartition(t, p, o) for (t, p), o in offsets.items()]

    def _store(self, db: psycopg.Connection[Any], offsets: list[TopicPartition]) -> None:
        if not offsets:
            return
        db.execute(self._queries.store_kafka_offsets, {
            "consumer": self.group, "offsets": json.dumps([
                {"topic": tp.topic, "partition": tp.partition, "next_offset": tp.offset}
                for tp in offsets if tp.offset != OFFSET_INVALID])})

    # -- connections ---------------------------------------------------------------------

    def _connection(self) -> psycopg.Connection[Any]:
        if self._db is None or self._db.closed:
            self._db = psycopg.connect(self._conninfo, autocommit=True,
                                       application_name=f"outbox kafka inbox {self.group}")
        return self._db

    def _close_db(self) -> None:
        db, self._db = self._db, None
        if db is not None:
            db.close()

    def _dead_letters(self) -> Producer:
        if self._producer is None:
            settings = {k: v for k, v in self._settings.items()
                        if k in ("bootstrap.servers",) or k.startswith(("security.", "sasl.",
                                                                          "ssl."))}
            self._producer = Producer({**settings, "enable.idempotence": True}, logger=log)
        return self._producer


def _event(message: Message) -> KafkaEvent:
    headers = {str(item[0]): _bytes(item[1]) for item in message.headers() or []}
    topic, partition, offset = message.topic() or "", message.partition() or 0, \
        message.offset() or 0
    key = headers.get(KEY_HEADER)
    message_id = key.decode(errors="replace") if key else f"{topic}:{partition}:{offset}"
    return KafkaEvent(message_id, topic, partition, offset, message.key(),
                      message.value() or b"", headers)


def _bytes(value: str | bytes | None) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value or b"")
