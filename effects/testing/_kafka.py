"""``KafkaMockCluster``: librdkafka's built-in mock Kafka cluster, held by a process of its
own for tests, with its fault controls (brokers down and up, slow responses, request
errors pushed).

librdkafka's mock cluster (what ``test.mock.num.brokers`` starts inside a client) speaks
the real protocol, idempotent producers and consumer groups included, auto-creates
topics (4 partitions) and keeps everything in memory. Unlike a real broker it does not
deduplicate an idempotent producer's retried batches (it checks sequence numbers for
transactional producers only): a batch it stored whose acknowledgement was lost (the
broker set down with the response unsent) is stored again when librdkafka retries it,
with the same bytes and timestamp, and the producer reports it delivered once.

Holding it in a child process lets a test kill -9 a producer or consumer process while
the cluster (and what it stored) survives. The holder creates the cluster through
librdkafka's C API (``ctypes``, on the library confluent-kafka ships), because that API
is also the only way to reach the mock cluster's fault controls, which confluent-kafka
does not expose in Python.

Run as ``python -m effects.testing._kafka BROKERS``: prints the bootstrap servers on one
line, then reads commands on its standard input, one a line, answering each with
``ok`` or ``error <why>`` on one line, until its input closes::

    down <broker id>                 the broker drops its connections and refuses new
                                     ones (its partitions get no new leader)
    up <broker id>                   it accepts connections again
    rtt <broker id> <ms>             the broker holds each response that long (it
                                     handles, and stores, the request at once)
    errors <api key> <code> ...      the next requests of that API (0 = Produce), one
                                     per code, fail with those Kafka error codes
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.util
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Self

__all__ = ["KafkaMockCluster"]

_START_TIMEOUT = 30.0
PRODUCE_API = 0  # Kafka's ApiKey of Produce requests


class KafkaMockCluster:
    """A mock Kafka cluster of ``brokers`` brokers on 127.0.0.1, in a child process.

    ``bootstrap_servers`` is what clients put in ``bootstrap.servers``; brokers are
    numbered 1 to ``brokers``. Use as a context manager; ``stop()`` ends it (and forgets
    everything it stored). The fault controls (``set_broker_down``, ``set_broker_up``,
    ``set_broker_rtt``, ``push_request_errors``) are thread-safe and return once the
    cluster applied them.
    """

    def __init__(self, brokers: int = 3) -> None:
        if brokers < 1:
            raise ValueError("a mock Kafka cluster needs at least 1 broker")
        self.brokers = brokers
        self.bootstrap_servers = ""
        self._process: subprocess.Popen[str] | None = None
        self._commands = threading.Lock()

    @property
    def broker_ids(self) -> list[int]:
        """The brokers' ids: 1 to ``brokers``."""
        return list(range(1, self.brokers + 1))

    def start(self) -> Self:
        """Start the holder process and read its bootstrap servers."""
        if self._process is not None:
            return self
        process = subprocess.Popen(
            [sys.executable, "-m", "effects.testing._kafka", str(self.brokers)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True)
        self._process = process
        assert process.stdout is not None
        line = process.stdout.readline().strip()
        if not line:
            self.stop()
            raise RuntimeError("the mock Kafka cluster did not start (librdkafka missing? "
                               "pip install confluent-kafka, part of outbox-pg[dev])")
        self.bootstrap_servers = line
        return self

    # -- faults ------------------------------------------------------------------------

    def set_broker_down(self, broker_id: int) -> None:
        """Broker ``broker_id`` drops its connections and refuses new ones until
        ``set_broker_up``; its partitions keep it as leader (no failover), so what is
        produced to them waits, or times out. A response not yet sent is dropped: a
        produce the broker stored unacknowledged is retried by the producer, and this
        mock stores it again (see the module docstring)."""
        self._command(f"down {self._checked(broker_id)}")

    def set_broker_up(self, broker_id: int) -> None:
        """Broker ``broker_id`` accepts connections again."""
        self._command(f"up {self._checked(broker_id)}")

    def set_broker_rtt(self, broker_id: int, milliseconds: int) -> None:
        """Broker ``broker_id`` sends each response ``milliseconds`` after handling its
        request (0: at once); what a request stores is stored meanwhile."""
        if milliseconds < 0:
            raise ValueError("a round-trip time cannot be negative")
        self._command(f"rtt {self._checked(broker_id)} {int(milliseconds)}")

    def push_request_errors(self, api_key: int, errors: Sequence[int]) -> None:
        """The next ``len(errors)`` requests of ``api_key`` (``PRODUCE_API`` = 0), on
        any broker, fail with these Kafka error codes, in order (e.g.
        ``KafkaError.NOT_LEADER_FOR_PARTITION``: the client retries by itself).

        Beware with an idempotent producer and Produce errors: librdkafka then reports
        some retried messages delivered (offset unknown) that the mock never stored, a
        few in 500 here; no broker does that, so a check of "every acknowledged message
        is stored" fails for the mock's sake, not the producer's."""
        if not errors:
            return
        self._command(f"errors {int(api_key)} " + " ".join(str(int(e)) for e in errors))

    def _checked(self, broker_id: int) -> int:
        if broker_id not in self.broker_ids:
            raise ValueError(f"no broker {broker_id}: brokers are {self.broker_ids}")
        return broker_id

    def _command(self, line: str) -> None:
        with self._commands:
            process = self._process
            if process is None or process.stdin is None or process.stdout is None:
                raise RuntimeError("the mock Kafka cluster is not running")
            process.stdin.write(line + "\n")
            process.stdin.flush()
            answer = process.stdout.readline().strip()
        if answer != "ok":
            raise RuntimeError(f"mock Kafka cluster: {line!r}: {answer or 'no answer'}")

    # -- lifetime ------------------------------------------------------------------------

    def exit_status(self) -> int | None:
        """The holder process's exit status once it ended (the cluster is then gone);
        None while it runs, or before ``start``."""
        process = self._process
        return None if process is None else process.poll()

    def stop(self) -> None:
        """End the cluster (its holder exits when its input closes)."""
        with self._commands:
            process, self._process = self._process, None
        if process is None:
            return
        assert process.stdin is not None
        process.stdin.close()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


# -- the holder process -------------------------------------------------------------------


def _librdkafka() -> ctypes.CDLL:
    """The librdkafka confluent-kafka uses: the one its wheel ships, else the system's."""
    spec = importlib.util.find_spec("confluent_kafka")
    if spec is not None and spec.submodule_search_locations:
        site = os.path.dirname(next(iter(spec.submodule_search_locations)))
        shipped = sorted(glob.glob(os.path.join(site, "confluent_kafka.libs", "librdkafka*")))
        if shipped:
            return ctypes.CDLL(shipped[0])
    found = ctypes.util.find_library("rdkafka")
    if found is None:
        raise RuntimeError("librdkafka not found (pip install confluent-kafka)")
    return ctypes.CDLL(found)


class _MockCluster:
    """The mock cluster through librdkafka's C API (``rdkafka_mock.h``)."""

    def __init__(self, brokers: int) -> None:
        lib = self._lib = _librdkafka()
        lib.rd_kafka_conf_new.restype = ctypes.c_void_p
        lib.rd_kafka_conf_set.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p,
                                          ctypes.c_char_p, ctypes.c_size_t]
        lib.rd_kafka_new.restype = ctypes.c_void_p
        lib.rd_kafka_new.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p,
                                     ctypes.c_size_t]
        lib.rd_kafka_mock_cluster_new.restype = ctypes.c_void_p
        lib.rd_kafka_mock_cluster_new.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.rd_kafka_mock_cluster_bootstraps.restype = ctypes.c_char_p
        lib.rd_kafka_mock_cluster_bootstraps.argtypes = [ctypes.c_void_p]
        for name in ("rd_kafka_mock_broker_set_down", "rd_kafka_mock_broker_set_up"):
            getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_int32]
            getattr(lib, name).restype = ctypes.c_int
        lib.rd_kafka_mock_broker_set_rtt.argtypes = [ctypes.c_void_p, ctypes.c_int32,
                                                     ctypes.c_int]
        lib.rd_kafka_mock_broker_set_rtt.restype = ctypes.c_int
        lib.rd_kafka_mock_push_request_errors_array.argtypes = [
            ctypes.c_void_p, ctypes.c_int16, ctypes.c_size_t, ctypes.POINTER(ctypes.c_int)]
        errstr = ctypes.create_string_buffer(512)
        conf = lib.rd_kafka_conf_new()
        lib.rd_kafka_conf_set(conf, b"log_level", b"0", errstr, len(errstr))
        # The handle only owns the cluster (a producer that never produces).
        self._handle = lib.rd_kafka_new(0, conf, errstr, len(errstr))
        if not self._handle:
            raise RuntimeError(f"librdkafka: {errstr.value.decode(errors='replace')}")
        self._cluster = lib.rd_kafka_mock_cluster_new(self._handle, brokers)
        if not self._cluster:
            raise RuntimeError("librdkafka did not create the mock cluster")

    @property
    def bootstrap_servers(self) -> str:
        return bytes(self._lib.rd_kafka_mock_cluster_bootstraps(self._cluster)).decode()

    def execute(self, words: list[str]) -> None:
        command, args = words[0], [int(word) for word in words[1:]]
        if command in ("down", "up") and len(args) == 1:
            function = getattr(self._lib, f"rd_kafka_mock_broker_set_{command}")
            if function(self._cluster, args[0]) != 0:
                raise ValueError(f"no broker {args[0]}")
        elif command == "rtt" and len(args) == 2:
            if self._lib.rd_kafka_mock_broker_set_rtt(self._cluster, args[0], args[1]) != 0:
                raise ValueError(f"no broker {args[0]}")
        elif command == "errors" and len(args) >= 2:
            codes = (ctypes.c_int * (len(args) - 1))(*args[1:])
            self._lib.rd_kafka_mock_push_request_errors_array(self._cluster, args[0],
                                                              len(args) - 1, codes)
        else:
            raise ValueError(f"unknown command {' '.join(words)!r}")


def _hold(brokers: int) -> None:
    cluster = _MockCluster(brokers)
    _answer(cluster.bootstrap_servers)
    for line in sys.stdin:  # until the test closes our input (or dies)
        words = line.split()
        if not words:
            continue
        try:
            cluster.execute(words)
        except (ValueError, RuntimeError) as exc:
            _answer(f"error {exc}")
        else:
            _answer("ok")


def _answer(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    _hold(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
