"""The Kafka half of a chaos run: librdkafka's mock cluster, a tail that counts what the
topic holds per job key, and a Kafka ``InboxConsumer`` in a process of its own.

``kafka.produce`` jobs produce to one topic with the job key as message key. Kafka does
not deduplicate by our key, so a message may be stored more than once for a key (a
worker killed or frozen between the broker's ack and ``done``, or a delivery report that
never came); the checks demand at least one message per done job, no more messages than
the attempts that could have produced one, and exactly one handling per key by the
consumer, which dedupes through the inbox and stores its offsets in PostgreSQL.

One repeat is the mock's own: it does not deduplicate the idempotent producer's retried
batches as a broker does (see ``effects.testing.KafkaMockCluster``), so a produce it
stored while a broker went down with the acknowledgement unsent is stored again by the
producer's retry, within one attempt that returns once. Such copies are the same
batch: one partition, one producer timestamp (librdkafka stamps a message when it is
handed over and resends it as it was), whereas every attempt hands over a message of
its own, stamped when it does. ``produced_per_key`` counts them once, and the checks
hold the attempts to that count (two attempts of one key handing over within one
millisecond would count once as well: a job's attempts follow one another, and only a
stale claim's can overlap the next).

Faults here: a broker set down for a while (its partitions keep it as leader, so their
produces wait or time out) and then up; and the consumer process killed (kill -9, then
replaced) or frozen (SIGSTOP, then SIGCONT).

Run as ``python -m effects.chaos.kafka``: the consumer process (settings as JSON in
``$OUTBOX_CHAOS_KAFKA_CONSUMER``); on SIGTERM it stops after the batch in hand and prints
its counters as one JSON line.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import psycopg
from confluent_kafka import TIMESTAMP_CREATE_TIME, Consumer, TopicPartition
from psycopg import sql

import outbox
from effects.kafka import InboxConsumer, KafkaEvent
from effects.testing import KafkaMockCluster

from ._sql import chaos_queries
from .schedule import KAFKA_TOPIC

__all__ = ["DEAD_TOPIC", "GROUP", "TOPIC", "ChaosKafka"]

log = logging.getLogger("effects.chaos")

TOPIC = KAFKA_TOPIC
DEAD_TOPIC = f"{TOPIC}.dlq"
GROUP = "chaos-kafka"
ENV_VARIABLE = "OUTBOX_CHAOS_KAFKA_CONSUMER"
_PARTITIONS = 4  # the mock cluster's default for an auto-created topic
_KEY_HEADER = "outbox-key"
# How long the end-marks client may keep failing before a fresh one replaces it.
_FRESH_CLIENT_AFTER = 5.0
# The shortest session the mock cluster accepts: a consumer that died is let go, and its
# successor takes the partitions, within seconds.
_FAST_GROUP = {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500, "log_level": 0}
_PROJECT_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class ConsumerSettings:
    """What the consumer process is told, as JSON in ``$OUTBOX_CHAOS_KAFKA_CONSUMER``
    (the DSN may hold a password: not on the command line)."""

    dsn: str
    schema: str
    chaos: str
    bootstrap_servers: str


class _Tail:
    """Reads the topic from its start on a thread of its own, counting messages per
    ``outbox-key`` and remembering which key each (partition, offset) holds."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self._consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "chaos-tail",
                                   "enable.auto.commit": False, "log_level": 0,
                                   "auto.offset.reset": "earliest"})
        self._consumer.assign([TopicPartition(topic, p, 0) for p in range(_PARTITIONS)])
        self._lock = threading.Lock()
        self._next: dict[int, int] = {}  # partition -> the offset after the last read
        self.per_key: Counter[str] = Counter()
        self.at: dict[tuple[int, int], str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-kafka-tail", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for message in self._consumer.consume(500, timeout=0.1):
                if message.error() is not None:
                    continue
                headers = dict(message.headers() or [])
                raw = headers.get(_KEY_HEADER)
                key = raw.decode() if isinstance(raw, bytes) else "(no outbox-key)"
                partition, offset = message.partition() or 0, message.offset() or 0
                with self._lock:
                    self.per_key[key] += 1
                    self.at[(partition, offset)] = key
                    self._next[partition] = offset + 1

    def replace(self, per_key: Counter[str], at: dict[tuple[int, int], str]) -> None:
        """Take what a full read of the topic found instead of what was tailed."""
        with self._lock:
            self.per_key, self.at = per_key, at

    def reached(self, ends: dict[int, int]) -> bool:
        """Whether every partition was read up to ``ends`` (partition -> high mark)."""
        with self._lock:
            return all(self._next.get(p, 0) >= end for p, end in ends.items())

    def stop(self) -> None:
        """Stop reading (what was read stays)."""
        self._stop.set()
        self._thread.join(10.0)

    def close(self) -> None:
        self.stop()
        self._consumer.close()


class ChaosKafka:
    """A mock Kafka cluster with the run's topic, its tail, and the consumer process.

    ``performed(key)`` is the number of messages the topic holds for ``key`` (read up to
    the end marks of the moment when the brokers answer). Thread-safe.
    """

    def __init__(self, log_dir: Path) -> None:
        self.cluster = KafkaMockCluster(brokers=3).start()
        self._log_dir = log_dir
        self._marks = self._marks_client()
        self._marks_error = ""  # why the end marks could not be read, the last time
        self._marks_failing_since: float | None = None  # the marks client's failures began
        self.drain_state = ""  # what wait_consumed last saw, when it was not there yet
        self._marks_lock = threading.Lock()
        self._tail = _Tail(self.bootstrap_servers, TOPIC)
        self._consumer: subprocess.Popen[bytes] | None = None
        self._consumer_lock = threading.Lock()
        self._settings: ConsumerSettings | None = None
        self.consumer_stats: Counter[str] = Counter()
        self.consumer_problems: list[str] = []
        self.consumer_kills = 0
        self.unstored: list[int] = []  # partitions a failover left with no stored offset
        self.consumer_stops = 0
        self.brokers_down = 0
        self._settled = False
        self._stamps: dict[tuple[int, int], int | None] = {}  # (partition, offset) -> ms
        self._generation = 0

    @property
    def bootstrap_servers(self) -> str:
        """Where the workers produce."""
        return self.cluster.bootstrap_servers

    # -- counting ----------------------------------------------------------------------

    def performed(self, key: str) -> int:
        """Messages the topic holds for ``key`` (0 or more: Kafka keeps repeats)."""
        if not self._settled:
            self.sync(2.0)
        return self._tail.per_key.get(key, 0)

    def performed_keys(self) -> list[str]:
        """Every key with a message in the topic."""
        if not self._settled:
            self.sync(2.0)
        return sorted(self._tail.per_key)

    def settle(self, timeout: float = 60.0) -> None:
        """Once nothing produces any more: read the whole topic afresh, from its start
        to its end marks, and answer from that read from then on."""
        deadline = time.monotonic() + timeout
        ends = self.end_marks(TOPIC, timeout)
        if ends is None:
            raise RuntimeError(self._marks_failure(TOPIC))
        reader = Consumer({"bootstrap.servers": self.bootstrap_servers, "log_level": 0,
                           "group.id": "chaos-settle", "enable.auto.commit": False})
        per_key: Counter[str] = Counter()
        at: dict[tuple[int, int], str] = {}
        stamps: dict[tuple[int, int], int | None] = {}
        try:
            reader.assign([TopicPartition(TOPIC, p, 0) for p, end in ends.items() if end])
            while len(at) < sum(ends.values()):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the topic {TOPIC} could not be read to its end: "
                                       f"{len(at)} of {sum(ends.values())} messages")
                for message in reader.consume(500, timeout=0.5):
                    if message.error() is None:
                        raw = dict(message.headers() or []).get(_KEY_HEADER)
                        key = raw.decode() if isinstance(raw, bytes) else "(no outbox-key)"
                        where = (message.partition() or 0, message.offset() or 0)
                        if where not in at:
                            per_key[key] += 1
                        at[where] = key
                        kind, stamp = message.timestamp()
                        stamps[where] = stamp if kind == TIMESTAMP_CREATE_TIME else None
        finally:
            reader.close()
        self._tail.stop()  # from now on the fresh read answers, and nothing adds to it
        self._tail.replace(per_key, at)
        self._stamps = stamps
        self._settled = True

    def messages_per_key(self) -> dict[str, int]:
        """Messages stored per job key (read to the end of the topic by ``settle``)."""
        if not self._settled:
            self.settle()
        return dict(self._tail.per_key)

    def produced_per_key(self) -> dict[str, int]:
        """Messages produced per job key: like ``messages_per_key``, with the copies of
        one batch that the mock stored again (one partition, one producer timestamp: see
        the module docstring) counted once. A message without its producer's timestamp
        counts on its own."""
        if not self._settled:
            self.settle()
        produced: set[tuple[str, int, int, bool]] = set()  # key, partition, stamp or offset
        for (partition, offset), key in self._tail.at.items():
            stamp = self._stamps.get((partition, offset))
            produced.add((key, partition, offset, False) if stamp is None
                         else (key, partition, stamp, True))
        return dict(Counter(key for key, *_ in produced))

    def key_at(self, partition: int, offset: int) -> str | None:
        """The ``outbox-key`` of the message at (partition, offset), if it exists."""
        return self._tail.at.get((partition, offset))

    def keys_in(self, partition: int) -> set[str]:
        """The ``outbox-key`` of every message read from ``partition``."""
        return {key for (p, _), key in list(self._tail.at.items()) if p == partition}

    def sync(self, timeout: float) -> bool:
        """Until the tail has read up to the topic's current end marks; False if the
        marks or the messages could not be had in ``timeout`` (a broker down)."""
        deadline = time.monotonic() + timeout
        ends = self.end_marks(TOPIC, timeout)
        while ends is not None and time.monotonic() < deadline:
            if self._tail.reached(ends):
                return True
            time.sleep(0.02)
        return False

    def end_marks(self, topic: str, timeout: float) -> dict[int, int] | None:
        """partition -> high watermark of ``topic``; None if a broker did not answer
        within ``timeout`` (asked again meanwhile: a connection may be coming back).

        A client that kept failing for ``_FRESH_CLIENT_AFTER`` seconds (over one call or
        several: callers ask with short timeouts, again and again) is replaced: once
        a broker was down and up, librdkafka's metadata may hold a partition as unknown
        for longer than a run can wait. (Not sooner: a fresh client's first asks fail
        too, with ``_UNKNOWN_PARTITION``, until its metadata arrives.)"""
        deadline = time.monotonic() + timeout
        ends = {}
        with self._marks_lock:
            for partition in range(_PARTITIONS):
                while partition not in ends:
                    try:
                        _, ends[partition] = self._marks.get_watermark_offsets(
                            TopicPartition(topic, partition),
                            timeout=max(0.1, min(_FRESH_CLIENT_AFTER,
                                                 deadline - time.monotonic())))
                        self._marks_failing_since = None
                    except Exception as exc:  # a broker down, or no such topic yet
                        if "UNKNOWN_TOPIC" in str(exc):
                            return {}
                        self._marks_error = f"partition {partition}: {exc}"
                        now = time.monotonic()
                        since = self._marks_failing_since
                        if since is None:
                            self._marks_failing_since = now
                        elif now - since >= _FRESH_CLIENT_AFTER:
                            self._marks.close()
                            self._marks = self._marks_client()
                            self._marks_failing_since = None
                        if now >= deadline:
                            return None
                        time.sleep(0.1)
        return ends

    def _marks_client(self) -> Consumer:
        return Consumer({"bootstrap.servers": self.bootstrap_servers, "log_level": 0,
                         "group.id": "chaos-marks", "reconnect.backoff.max.ms": 500})

    def _marks_failure(self, topic: str) -> str:
        """Why the end marks of ``topic`` could not be read, for an error message."""
        holder = self.cluster.exit_status()
        state = "running" if holder is None else f"exited with status {holder}"
        return (f"the end marks of topic {topic} could not be read ({self._marks_error}; "
                f"the mock cluster's process: {state})")

    def dead_letters(self) -> int:
        """Messages the consumer parked (its handler never fails: must be 0)."""
        ends = self.end_marks(DEAD_TOPIC, 10.0)
        return sum((ends or {}).values())

    # -- faults ------------------------------------------------------------------------

    def broker_down(self, broker_id: int) -> None:
        """Set one broker down (until ``broker_up``)."""
        self.cluster.set_broker_down(broker_id)

    def broker_up(self, broker_id: int) -> None:
        """Bring a broker set down back."""
        self.cluster.set_broker_up(broker_id)
        self.brokers_down += 1

    def kill_consumer(self) -> bool:
        """kill -9 the consumer process and start its successor; False if none ran."""
        with self._consumer_lock:
            process = self._consumer
            if process is None or process.poll() is not None:
                return False
            process.send_signal(signal.SIGKILL)
            process.communicate()
            self.consumer_kills += 1
            self._spawn()
        return True

    def freeze_consumer(self) -> bool:
        """SIGSTOP the consumer (until ``thaw_consumer``; past its session timeout, the
        group lets it go); False if none ran."""
        with self._consumer_lock:
            process = self._consumer
            if process is None or process.poll() is not None:
                return False
            process.send_signal(signal.SIGSTOP)
            self.consumer_stops += 1
        return True

    def thaw_consumer(self) -> None:
        """SIGCONT the consumer (harmless if it is not frozen)."""
        with self._consumer_lock:
            process = self._consumer
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGCONT)

    # -- the consumer ------------------------------------------------------------------

    def start_consumer(self, dsn: str, schema: str, chaos: str) -> None:
        """Start the consumer process (the inbox into ``<chaos>.consumed``)."""
        with self._consumer_lock:
            self._settings = ConsumerSettings(dsn, schema, chaos, self.bootstrap_servers)
            self._spawn()

    def _spawn(self) -> None:
        assert self._settings is not None
        self._generation += 1
        python_path = os.pathsep.join(p for p in (str(_PROJECT_ROOT),
                                                  os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, ENV_VARIABLE: json.dumps(asdict(self._settings)),
               "PYTHONPATH": python_path}
        log_path = self._log_dir / f"kafka-consumer-{self._generation}.log"
        with log_path.open("wb") as log_file:
            self._consumer = subprocess.Popen(
                [sys.executable, "-m", "effects.chaos.kafka"], cwd=self._log_dir, env=env,
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log_file)

    def wait_consumed(self, dsn: str, schema: str, timeout: float,
                      unstored_ok: bool = False) -> bool:
        """Until the offsets the consumer stored in PostgreSQL reach the topic's end
        marks; False on timeout. ``unstored_ok`` (after a lossy failover): a partition
        with no stored offset at all is not waited for, and is named in ``unstored``.
        Its offset row was lost with the old primary: the consumer then starts it from
        the group's Kafka offset (``effects._kafka_consumer``), past the messages whose
        handlings were lost, and stores nothing more for it until a new message comes."""
        deadline = time.monotonic() + timeout
        query = sql.SQL("SELECT partition, next_offset FROM {}.kafka_offsets "
                        "WHERE consumer = %s AND topic = %s").format(sql.Identifier(schema))
        while time.monotonic() < deadline:
            ends = self.end_marks(TOPIC, 5.0)
            try:
                with psycopg.connect(dsn, autocommit=True, connect_timeout=5,
                                     application_name="chaos kafka drain") as conn:
                    stored = {int(p): int(o) for p, o in conn.execute(query, (GROUP, TOPIC))}
            except psycopg.OperationalError:
                stored = None
            if ends is not None and stored is not None and unstored_ok:
                self.unstored = sorted(p for p, end in ends.items()
                                       if end > 0 and p not in stored)
                ends = {p: end for p, end in ends.items() if p in stored}
            if ends is not None and stored is not None and all(
                    stored.get(p, 0) >= end for p, end in ends.items() if end > 0):
                return True
            self.drain_state = (f"end marks {ends if ends is not None else 'unread'}, "
                                f"offsets stored {stored if stored is not None else 'unread'}")
            time.sleep(0.2)
        return False

    def stop_consumer(self, timeout: float = 30.0) -> None:
        """SIGTERM the consumer and collect its counters."""
        with self._consumer_lock:
            process, self._consumer = self._consumer, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGCONT)
            process.send_signal(signal.SIGTERM)
        try:
            out, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            self.consumer_problems.append(f"the Kafka consumer did not stop within "
                                          f"{timeout:.0f} s of SIGTERM")
            return
        lines = [line for line in out.decode(errors="replace").splitlines()
                 if line.startswith("{")]
        if process.returncode != 0 or not lines:
            self.consumer_problems.append(f"the Kafka consumer exited with status "
                                          f"{process.returncode} after SIGTERM")
            return
        self.consumer_stats.update(json.loads(lines[-1]))

    def close(self) -> None:
        """Stop the consumer (killed if it will not stop), the tail and the cluster."""
        with self._consumer_lock:
            process, self._consumer = self._consumer, None
        if process is not None:
            if process.poll() is None:
                process.kill()
            process.communicate()
        try:
            self._tail.close()
            with self._marks_lock:
                self._marks.close()
        finally:
            self.cluster.stop()


# -- the consumer process -------------------------------------------------------------------


def _consume(settings: ConsumerSettings) -> dict[str, int]:
    insert = chaos_queries(settings.schema, settings.chaos).consumed_insert

    def handle(tx: outbox.Transaction, event: KafkaEvent) -> None:
        tx.connection.execute(insert, {"message_id": event.message_id, "source": "kafka",
                                       "subject": f"{event.partition}:{event.offset}"})

    consumer = InboxConsumer(settings.dsn, handle, bootstrap_servers=settings.bootstrap_servers,
                             topics=[TOPIC], group=GROUP, schema=settings.schema, batch=64,
                             max_attempts=20, backoff=(0.1, 0.5, 1.0), config=_FAST_GROUP)
    signal.signal(signal.SIGTERM, lambda *_: consumer.stop())
    stats = consumer.run()
    return {"handled": stats.handled, "duplicates": stats.duplicates, "failed": stats.failed,
            "dead_lettered": stats.dead_lettered}


def main() -> None:
    """Entry point of the consumer process."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stats = _consume(ConsumerSettings(**json.loads(os.environ[ENV_VARIABLE])))
    sys.stdout.write(json.dumps(stats) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
