"""Section 4, latency-bound effects: a provider answering in 50 ms, a dispatcher at
concurrency 16, 64 and 256 with a sync httpx effect on its worker threads, and at 256
with an ``async def perform`` on httpx.AsyncClient. Throughput is compared with the
ideal, concurrency / latency.

The provider is a real HTTP/1.1 server (asyncio, keep-alive) on 127.0.0.1 in a process
of its own; it counts the requests it answered, which must cover every job.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from multiprocessing.synchronize import Event as EventType
from typing import Any

import outbox

from ._db import Server, fresh_database, migrated, settle
from ._effects import HTTP, AsyncHttpCall, HttpCall
from ._procs import Prepared, context, run_released, service
from ._results import Row, Section, Target
from ._seed import seed_pending
from ._stats import Figure, ratios

MAX_SERVICE_SECONDS = 1800.0
_RESPONSE = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
             b"content-length: 11\r\n\r\n{\"ok\":true}")


@dataclass(frozen=True)
class LatencyConfig:
    runs: int
    concurrencies: tuple[int, ...] = (16, 64, 256)
    async_concurrencies: tuple[int, ...] = (256,)
    delay: float = 0.05
    seconds_of_work: float = 3.0  # jobs = ideal throughput x this, within the bounds below
    max_jobs: int = 1000  # where the client is far from the ideal, a run takes that longer

    def jobs(self, concurrency: int) -> int:
        ideal = round(concurrency / self.delay * self.seconds_of_work)
        return max(concurrency, min(ideal, self.max_jobs))


@dataclass(frozen=True)
class ProviderSpec:
    delay: float
    stop: EventType


@dataclass(frozen=True)
class HttpWorkerSpec:
    dsn: str
    url: str
    concurrency: int
    async_effect: bool
    timeout: float


@dataclass(frozen=True)
class ClientSpec:
    url: str
    concurrency: int
    async_effect: bool
    jobs: int


# -- the provider (child process) --------------------------------------------------------------

def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    return 0


class _Provider:
    """Answers every request after ``delay`` seconds; counts them."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.answered = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = _content_length(head)
                if length:
                    await reader.readexactly(length)
                await asyncio.sleep(self.delay)
                writer.write(_RESPONSE)
                await writer.drain()
                self.answered += 1
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()


def provider_worker(spec: ProviderSpec) -> Prepared:
    """Listen on 127.0.0.1 (a free port) until ``spec.stop``; info is the base URL."""
    loop = asyncio.new_event_loop()
    provider = _Provider(spec.delay)
    server = loop.run_until_complete(
        asyncio.start_server(provider.handle, "127.0.0.1", 0, backlog=1024))
    port = server.sockets[0].getsockname()[1]

    async def serve() -> None:
        # The stop event is a multiprocessing one: wait for it on a thread.
        await loop.run_in_executor(None, spec.stop.wait, MAX_SERVICE_SECONDS)
        server.close()

    def run() -> int:
        try:
            loop.run_until_complete(serve())
        finally:
            loop.close()
        return provider.answered

    return Prepared(run, info=f"http://127.0.0.1:{port}/emails")


# -- the dispatcher (child process) -----------------------------------------------------------

def http_worker(spec: HttpWorkerSpec) -> Prepared:
    """Our dispatcher with the HTTP effect, draining what was enqueued."""
    effect: outbox.Effect
    if spec.async_effect:
        effect = AsyncHttpCall(spec.url, spec.concurrency)
    else:
        effect = HttpCall(spec.url, spec.concurrency)
    dispatcher = outbox.Dispatcher(spec.dsn, [effect], concurrency=spec.concurrency)

    def run() -> dict[str, Any]:
        return dispatcher.run_until_idle(timeout=spec.timeout).as_dict()

    return Prepared(run)


def _fake_job(n: int) -> outbox.Job:
    return outbox.Job(id=n, effect=HTTP, key=f"raw-{n}", payload={}, attempt=1,
                      claim_version=1)


def _threads_loop(effect: HttpCall, jobs: int, concurrency: int) -> int:
    numbers = iter(range(jobs))
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                n = next(numbers, None)
            if n is None:
                return
            effect.perform(_fake_job(n))

    threads = [threading.Thread(target=work) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return jobs


async def _tasks_loop(effect: AsyncHttpCall, jobs: int, concurrency: int) -> int:
    numbers = iter(range(jobs))

    async def work() -> None:
        for n in numbers:  # shared iterator: each task takes the next number
            await effect.perform(_fake_job(n))

    await asyncio.gather(*(work() for _ in range(concurrency)))
    return jobs


def client_worker(spec: ClientSpec) -> Prepared:
    """The second baseline: the same effect called in a plain loop by ``concurrency``
    threads (or tasks), no database: what the HTTP client can do on this machine."""

    def run() -> int:
        if spec.async_effect:
            effect = AsyncHttpCall(spec.url, spec.concurrency)
            return asyncio.run(_tasks_loop(effect, spec.jobs, spec.concurrency))
        return _threads_loop(HttpCall(spec.url, spec.concurrency), spec.jobs, spec.concurrency)

    return Prepared(run)


# -- the parent's side ------------------------------------------------------------------------

def _drain(server: Server, config: LatencyConfig, url: str, concurrency: int,
           async_effect: bool) -> float:
    """Our dispatcher drains latency-bound jobs; jobs/s."""
    jobs = config.jobs(concurrency)
    with fresh_database(server, "latency") as dsn:
        migrated(dsn)
        seed_pending(dsn, jobs, prefix="http-", effect=HTTP)
        settle(dsn)
        timeout = 60.0 + jobs * config.delay
        released = run_released(http_worker,
                                [HttpWorkerSpec(dsn, url, concurrency, async_effect, timeout)],
                                timeout=timeout + 30)
    done = released.results[0]["done"]
    if done != jobs:
        raise AssertionError(f"latency run finished {done} of {jobs} jobs")
    return jobs / released.seconds


def _client(config: LatencyConfig, url: str, concurrency: int, async_effect: bool) -> float:
    """The same calls without the dispatcher; calls/s."""
    jobs = config.jobs(concurrency)
    released = run_released(client_worker, [ClientSpec(url, concurrency, async_effect, jobs)],
                            timeout=60.0 + jobs * config.delay)
    return jobs / released.seconds


def measure(server: Server, config: LatencyConfig, url: str, concurrency: int,
            async_effect: bool) -> dict[str, Any]:
    """One run of a variant: the dispatcher, the bare client, and the ideal."""
    return {"concurrency": concurrency, "async": async_effect,
            "jobs": config.jobs(concurrency), "ideal": concurrency / config.delay,
            "outbox": _drain(server, config, url, concurrency, async_effect),
            "client": _client(config, url, concurrency, async_effect)}


def _variants(config: LatencyConfig) -> list[tuple[int, bool]]:
    return ([(c, False) for c in config.concurrencies]
            + [(c, True) for c in config.async_concurrencies])


def _rows(config: LatencyConfig, results: list[dict[str, Any]]) -> list[Row]:
    rows = []
    for concurrency, async_effect in _variants(config):
        mine = [r for r in results
                if r["concurrency"] == concurrency and r["async"] == async_effect]
        if not mine:
            continue
        ours, client = [r["outbox"] for r in mine], [r["client"] for r in mine]
        ideal = [r["ideal"] for r in mine]
        kind = "async AsyncClient" if async_effect else "sync Client"
        target = Target(">=", 0.8) if concurrency == 64 and not async_effect else None
        name = f"outbox, httpx {kind}, concurrency {concurrency}"
        note = f"{mine[0]['jobs']} jobs"
        rows.append(Row("latency", name, "jobs/s", Figure.of(ours),
                        f"ideal {concurrency}/{config.delay:g}s", Figure.of(ideal),
                        ratios(ours, ideal), target, note=note))
        rows.append(Row("latency", f"{name}, vs the bare client", "jobs/s", Figure.of(ours),
                        "same calls, no dispatcher", Figure.of(client), ratios(ours, client)))
    return rows


def run(server: Server, config: LatencyConfig) -> Section:
    """Every variant ``config.runs`` times, interleaved, against one provider."""
    stop = context().Event()
    results: list[dict[str, Any]] = []
    with service(provider_worker, ProviderSpec(config.delay, stop), stop_event=stop,
                 timeout=30.0) as url:
        for _ in range(config.runs):
            for concurrency, async_effect in _variants(config):
                results.append(measure(server, config, url, concurrency, async_effect))
    settings = {"provider": f"asyncio HTTP/1.1 on 127.0.0.1, {config.delay * 1000:.0f} ms "
                "per request", "dispatcher": "concurrency as listed, other settings default",
                "bare client": "the same effect object called by N threads (tasks) in a loop"}
    return Section("latency", _rows(config, results),
                   raw={"config": vars(config), "runs": results}, settings=settings)
