"""Fixtures: the dashboard app over a fresh schema, driven through httpx's ASGI transport."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

from outbox.web import create_app

SAME_ORIGIN = {"sec-fetch-site": "same-origin"}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


ClientFactory = Callable[..., Any]


@pytest.fixture
async def make_client(dsn: str, schema: str) -> AsyncIterator[ClientFactory]:
    """Build clients for apps made with ``create_app(dsn, schema=schema, **options)``."""
    opened: list[tuple[Starlette, httpx.AsyncClient]] = []

    async def make(conninfo: str | None = None, **options: Any) -> httpx.AsyncClient:
        app = create_app(conninfo or dsn, schema=schema, **options)
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                   base_url="http://testserver")
        opened.append((app, client))
        return client

    yield make
    for app, client in opened:
        await client.aclose()
        await app.state.outbox.close()


@pytest.fixture
async def client(make_client: ClientFactory) -> httpx.AsyncClient:
    """A client of the dashboard with default options (no auth, writable)."""
    made: httpx.AsyncClient = await make_client()
    return made
