"""``KafkaMockCluster``: librdkafka's built-in mock Kafka cluster, held by a process of its
own for tests.

librdkafka starts a mock cluster inside any client configured with
``test.mock.num.brokers``; its brokers listen on loopback for as long as that client
lives. Holding it in a child process lets a test kill -9 a producer or consumer process
while the cluster (and what it stored) survives. The mock cluster auto-creates topics
(4 partitions) and speaks the real protocol, idempotent producers and consumer groups
included; it keeps everything in memory.

Run as ``python -m effects.testing._kafka BROKERS``: prints the bootstrap servers (read
back from the client's metadata) on one line, then holds the cluster until its standard
input closes.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Self

__all__ = ["KafkaMockCluster"]

_START_TIMEOUT = 30.0


class KafkaMockCluster:
    """A mock Kafka cluster of ``brokers`` brokers on 127.0.0.1, in a child process.

    ``bootstrap_servers`` is what clients put in ``bootstrap.servers``. Use as a context
    manager; ``stop()`` ends it (and forgets everything it stored).
    """

    def __init__(self, brokers: int = 3) -> None:
        self.brokers = brokers
        self.bootstrap_servers = ""
        self._process: subprocess.Popen[str] | None = None

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
                               "pip install confluent-kafka, part of outbox[dev])")
        self.bootstrap_servers = line
        return self

    def stop(self) -> None:
        """End the cluster (its holder exits when its input closes)."""
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


def _hold(brokers: int) -> None:
    from confluent_kafka import Producer

    holder = Producer({"test.mock.num.brokers": brokers, "log_level": 0})
    metadata = holder.list_topics(timeout=_START_TIMEOUT)
    servers = ",".join(f"{b.host}:{b.port}" for b in sorted(
        metadata.brokers.values(), key=lambda b: b.id))
    sys.stdout.write(servers + "\n")
    sys.stdout.flush()
    sys.stdin.read()  # until the test closes our input (or dies)


if __name__ == "__main__":
    _hold(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
