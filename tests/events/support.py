"""Helpers for the NATS tests: streams made and read over a connection of their own."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

import nats
from nats.js import JetStreamContext
from nats.js.api import StreamConfig

import outbox

T = TypeVar("T")


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run one coroutine on a fresh event loop, as a synchronous test would."""
    return asyncio.run(coroutine)


async def _with_js(url: str, action: Callable[[JetStreamContext], Awaitable[T]]) -> T:
    client = await nats.connect(url, connect_timeout=5, allow_reconnect=False)
    try:
        return await action(client.jetstream())
    finally:
        await client.close()


def new_stream_name() -> str:
    return f"T{uuid.uuid4().hex[:10].upper()}"


def add_stream(url: str, name: str | None = None, **config: Any) -> str:
    """Create a stream capturing ``<name>.>`` (with ``config`` overrides); its name."""
    name = name or new_stream_name()
    config.setdefault("subjects", [f"{name}.>"])

    async def add(js: JetStreamContext) -> None:
        await js.add_stream(StreamConfig(name=name, **config))

    run(_with_js(url, add))
    return name


def delete_stream(url: str, name: str) -> None:
    async def delete(js: JetStreamContext) -> None:
        await js.delete_stream(name)

    run(_with_js(url, delete))


@dataclass(frozen=True)
class Stored:
    """One message as the stream keeps it."""

    seq: int
    subject: str
    data: bytes
    headers: dict[str, str]


def messages(url: str, stream: str) -> list[Stored]:
    """Every message in ``stream``, in sequence order."""

    async def read(js: JetStreamContext) -> list[Stored]:
        info = await js.stream_info(stream)
        found = []
        first, last = info.state.first_seq, info.state.last_seq
        for seq in range(first, last + 1) if info.state.messages else ():
            try:
                msg = await js.get_msg(stream, seq)
            except nats.js.errors.NotFoundError:
                continue
            found.append(Stored(msg.seq or seq, msg.subject or "", msg.data or b"",
                                dict(msg.headers or {})))
        return found

    return run(_with_js(url, read))


def per_key(url: str, stream: str) -> Counter[str]:
    """How many stored messages carry each ``Nats-Msg-Id``."""
    return Counter(m.headers.get("Nats-Msg-Id", "") for m in messages(url, stream))


def make_job(
    key: str, payload: dict[str, Any], *, attempt: int = 1,
    first_attempted_at: datetime | None = None, ordering_key: str | None = None,
) -> outbox.Job:
    """A ``nats.publish`` job as the dispatcher hands it over."""
    return outbox.Job(
        id=1, effect="nats.publish", key=key, payload=payload, attempt=attempt,
        claim_version=attempt, ordering_key=ordering_key, max_attempts=25,
        first_attempted_at=first_attempted_at or datetime.now(UTC),
    )


def stored_count(url: str, stream: str) -> int:
    """How many messages ``stream`` holds (cheap: one stream info request)."""

    async def count(js: JetStreamContext) -> int:
        return int((await js.stream_info(stream)).state.messages)

    return run(_with_js(url, count))
