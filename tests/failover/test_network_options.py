"""The options a dispatcher connection is opened with (``connection_params``, from
``network_options``): the connection string's own timeouts, keepalives and
``PGCONNECT_TIMEOUT`` win over the defaults, read back from libpq on live connections."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from outbox import Effect, Job
from outbox._dispatch.connection import connection_params
from outbox._dispatch.network import NETWORK_DEFAULTS, network_options
from outbox._dispatch.settings import Settings

from .support import Pair, pair


class Shared(Effect):
    name = "shared.effect"

    def perform(self, job: Job) -> None:
        return None


@pytest.fixture(scope="module")
def servers() -> Iterator[Pair]:
    with pair() as made:
        yield made


def _libpq(conn: psycopg.Connection[Any]) -> dict[str, str]:
    return {o.keyword.decode(): (o.val or b"").decode() for o in conn.pgconn.info}


def test_connect_timeout_of_the_dsn_or_the_environment_is_honoured(
        servers: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    primary = servers.primary

    def opened(conninfo: str) -> dict[str, str]:
        params = connection_params(Settings.build(conninfo, effects=[Shared()]), "claimer")
        with psycopg.connect(params.conninfo, **params.options) as conn:
            return _libpq(conn)

    assert opened(f"{primary.dsn} connect_timeout=3")["connect_timeout"] == "3"
    defaults = opened(primary.dsn)
    assert {name: defaults[name] for name in NETWORK_DEFAULTS} == {
        name: str(value) for name, value in NETWORK_DEFAULTS.items()}
    # A URI's parameters count as the string's own, like keyword=value ones.
    uri = f"postgresql://postgres@127.0.0.1:{primary.port}/postgres?keepalives_idle=21"
    assert opened(uri)["keepalives_idle"] == "21"
    monkeypatch.setenv("PGCONNECT_TIMEOUT", "4")
    assert "connect_timeout" not in network_options(primary.dsn)
    assert opened(primary.dsn)["connect_timeout"] == "4"
