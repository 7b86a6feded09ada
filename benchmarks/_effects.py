"""The effects the benchmarks dispatch: no-ops, a wake-up stamp, an HTTP call."""

from __future__ import annotations

import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import httpx

import outbox

NOOP = "bench.noop"
STAMP = "bench.stamp"
HTTP = "bench.http"


class Noop(outbox.Effect):
    """Does nothing, on the dispatcher's worker threads."""

    name = NOOP

    def perform(self, job: outbox.Job) -> None:
        return None


class AsyncNoop(outbox.Effect):
    """Does nothing, on the dispatcher's event loop."""

    name = NOOP

    async def perform(self, job: outbox.Job) -> None:
        return None


class Stamp(outbox.Effect):
    """Sends (sample number, time.monotonic_ns()) through a pipe the moment it starts.

    CLOCK_MONOTONIC is one clock for every process of the machine, so the parent can
    subtract its own commit time from it.
    """

    name = STAMP

    def __init__(self, pipe: Connection) -> None:
        self._pipe = pipe
        self._lock = threading.Lock()

    def perform(self, job: outbox.Job) -> None:
        now = time.monotonic_ns()
        with self._lock:
            self._pipe.send((job.payload["sample"], now))


class HttpCall(outbox.Effect):
    """POSTs the payload to a local fake provider with a shared ``httpx.Client``."""

    name = HTTP

    def __init__(self, url: str, connections: int) -> None:
        self._url = url
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        self._client = httpx.Client(limits=limits, timeout=30.0)

    def perform(self, job: outbox.Job) -> None:
        self._client.post(self._url, json=job.payload).raise_for_status()

    def close(self) -> None:
        self._client.close()


class AsyncHttpCall(outbox.Effect):
    """The ``async def perform`` twin of ``HttpCall`` with an ``httpx.AsyncClient``.

    The client is made on first use, on the dispatcher's event loop, which owns it.
    """

    name = HTTP

    def __init__(self, url: str, connections: int) -> None:
        self._url = url
        self._limits = httpx.Limits(max_connections=connections,
                                    max_keepalive_connections=connections)
        self._client: httpx.AsyncClient | None = None

    async def perform(self, job: outbox.Job) -> None:
        if self._client is None:
            self._client = httpx.AsyncClient(limits=self._limits, timeout=30.0)
        response = await self._client.post(self._url, json=job.payload)
        response.raise_for_status()


def payload(n: int) -> dict[str, Any]:
    """The small payload every benchmark job carries."""
    return {"n": n}
