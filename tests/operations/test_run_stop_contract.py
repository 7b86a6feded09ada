"""One run/stop contract for everything that runs: both dispatchers, both inbox consumers.

- ``stop()`` before ``run()``: ``run()`` returns at once, having consumed or claimed
  nothing.
- ``stop()`` while the database or the broker cannot be reached: ``run()`` returns
  promptly instead of retrying the connection for ever.

(``stop_timeout``, a perform that never returns, is proven with real processes in
``tests/crash/test_heartbeat_and_stop.py``.) Each runnable is started on a thread of its
own; "returns" is checked by joining that thread with a generous bound, as a liveness
check, not a measure of speed.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

import outbox
from effects.kafka import InboxConsumer as KafkaInboxConsumer
from effects.nats import InboxConsumer as NatsInboxConsumer
from effects.testing import KafkaMockCluster, NatsServer

LIVENESS = 30.0  # seconds: far beyond any prompt return, short of the test's own timeout


class Runnable:
    """A runnable on a thread: ``run()`` there, ``stop()`` from here."""

    def __init__(self, run: Callable[[], Any], stop: Callable[[], None]) -> None:
        self._run, self.stop = run, stop
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._body, name="runnable", daemon=True)

    def _body(self) -> None:
        try:
            self.result = self._run()
        except BaseException as exc:
            self.error = exc

    def start(self) -> None:
        self.thread.start()

    def returned(self) -> bool:
        self.thread.join(LIVENESS)
        if self.error is not None:
            raise self.error
        return not self.thread.is_alive()


class Noop(outbox.Effect):
    name = "contract.noop"

    def perform(self, job: outbox.Job) -> None:
        return None


def _free_port() -> int:
    """A local port nothing listens on (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def _make(kind: str, dsn: str, schema: str, *, nats_url: str = "",
          kafka_servers: str = "") -> Runnable:
    if kind == "dispatcher":
        sync = outbox.Dispatcher(dsn, [Noop()], schema=schema, poll_interval=0.05)
        return Runnable(sync.run, sync.stop)
    if kind == "async dispatcher":
        flavour = outbox.AsyncDispatcher(dsn, [Noop()], schema=schema, poll_interval=0.05)
        return Runnable(lambda: asyncio.run(flavour.run()), flavour.stop)
    if kind == "nats consumer":
        nats = NatsInboxConsumer(dsn, lambda tx, event: None, servers=nats_url,
                                 stream="CONTRACT", name="contract", schema=schema,
                                 connect_options={"connect_timeout": 0.5})
        return Runnable(lambda: asyncio.run(nats.run()), nats.stop)
    kafka = KafkaInboxConsumer(dsn, lambda tx, event: None, bootstrap_servers=kafka_servers,
                               topics=["contract"], group="contract", schema=schema)
    return Runnable(kafka.run, kafka.stop)


KINDS = ["dispatcher", "async dispatcher", "nats consumer", "kafka consumer"]


@pytest.fixture(scope="module")
def kafka() -> Iterator[KafkaMockCluster]:
    with KafkaMockCluster() as cluster:
        yield cluster


@pytest.mark.parametrize("kind", KINDS)
def test_a_stop_before_run_makes_run_return_at_once(
    kind: str, dsn: str, schema: str, nats_server: NatsServer, kafka: KafkaMockCluster,
) -> None:
    runnable = _make(kind, dsn, schema, nats_url=nats_server.url,
                     kafka_servers=kafka.bootstrap_servers)
    runnable.stop()
    runnable.start()
    assert runnable.returned(), f"the {kind} ran on after a stop() made before run()"


@contextmanager
def _first_log(logger: str, needle: str) -> Iterator[threading.Event]:
    """An event set when ``logger`` first logs a line containing ``needle``."""
    seen = threading.Event()

    class Watch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if needle in record.getMessage():
                seen.set()

    handler, target = Watch(), logging.getLogger(logger)
    old_level = target.level
    target.addHandler(handler)
    target.setLevel(logging.DEBUG)
    try:
        yield seen
    finally:
        target.removeHandler(handler)
        target.setLevel(old_level)


# What each runnable logs once it is retrying an unreachable peer.
UNREACHABLE = {
    "dispatcher": ("outbox.dispatcher", "cannot reach the database"),
    "async dispatcher": ("outbox.dispatcher", "cannot reach the database"),
    "nats consumer": ("effects.nats.consumer", "connection error"),
    "kafka consumer": ("effects.kafka.consumer", "Connection refused"),
}


@pytest.mark.parametrize("kind", KINDS)
def test_a_stop_while_the_peer_is_unreachable_makes_run_return(
    kind: str, dsn: str, schema: str,
) -> None:
    port = _free_port()
    # The dispatchers' peer is the database; the consumers' is their broker.
    peer_dsn = (f"postgresql://postgres@127.0.0.1:{port}/postgres?connect_timeout=2"
                if "dispatcher" in kind else dsn)
    runnable = _make(kind, peer_dsn, schema, nats_url=f"nats://127.0.0.1:{port}",
                     kafka_servers=f"127.0.0.1:{port}")
    with _first_log(*UNREACHABLE[kind]) as retrying:
        runnable.start()
        assert retrying.wait(LIVENESS), f"the {kind} never said it was retrying"
        runnable.stop()
        assert runnable.returned(), f"the {kind} ran on after a stop() while unreachable"
