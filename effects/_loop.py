"""``LoopThread``: a private asyncio loop on a thread, callable from any thread or loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["LoopThread"]

T = TypeVar("T")


class LoopThread:
    """An event loop of its own on a daemon thread, for connections bound to one loop.

    nats-py binds a connection to the loop that made it. Keeping it on a loop of its own
    lets a coroutine using it be awaited from any other loop (the dispatcher's, a test's
    ``asyncio.run``) and lets it be closed from any thread.
    """

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), name=name, daemon=True)
        self._thread.start()
        ready.wait()

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(ready.set)
        self.loop.run_forever()

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def call(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coroutine`` on this loop and wait for it from a thread not running it."""
        return self.submit(coroutine).result(timeout)

    async def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Await ``coroutine`` on this loop from another loop."""
        return await asyncio.wrap_future(self.submit(coroutine))

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()
