"""What ``nats.publish`` takes from nats-py's client: its header encoding (ours must write
the same bytes) and the internals it writes through (a clear error when they change)."""

from __future__ import annotations

import asyncio

import nats.errors
import pytest
from nats.aio.client import Client

from effects.nats import PublishEvent, _header_block, _send, check_client_internals
from outbox import ConfigurationError


class Capturing(Client):
    """nats-py's client, connected as far as a publish can tell, keeping what it writes
    instead of sending it: the same code path up to the socket."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[bytes] = []

    @property
    def is_connected(self) -> bool:
        return True

    async def _send_command(self, cmd: bytes, priority: bool = False) -> None:
        self.written.append(bytes(cmd))

    async def _flush_pending(self, force_flush: bool = False) -> None:
        return None


HEADER_SETS = [
    {"Nats-Msg-Id": "evt-order-102-paid"},
    {"Nats-Msg-Id": "k", "x-tenant": "  t1  ", " Spaced-Name ": "v", "": "skipped"},
    {"Nats-Msg-Id": "k", "traceparent": "00-abc-def-01", "multi": "line\r\nbreak\nhere"},
    {"Nats-Msg-Id": "k", "unicode": "caf\u00e9 \u2713"},
]


@pytest.mark.parametrize("headers", HEADER_SETS)
def test_our_header_block_is_byte_for_byte_what_nats_py_writes(headers: dict[str, str]) -> None:
    async def both() -> tuple[list[bytes], list[bytes]]:
        theirs, ours = Capturing(), Capturing()
        await theirs.publish("orders.paid", b'{"order": 102}', reply="_INBOX.r",
                             headers=headers)
        await _send(ours, "orders.paid", "_INBOX.r", _header_block(headers), b'{"order": 102}')
        return theirs.written, ours.written

    theirs, ours = asyncio.run(both())
    assert len(theirs) == 1
    assert ours == theirs


def test_a_header_name_nats_py_refuses_is_refused_alike() -> None:
    with pytest.raises(nats.errors.BadHeaderError):
        asyncio.run(Capturing().publish("s", b"", headers={"bad name": "v"}))
    with pytest.raises(nats.errors.BadHeaderError):
        _header_block({"bad name": "v"})


class WithoutInternals:
    """A client as a nats-py release that renamed its internals would make it."""

    def __init__(self) -> None:
        self.stats = {"out_msgs": 0, "out_bytes": 0}
        self.options: dict[str, object] = {}

    async def _send_command(self, cmd: bytes) -> None:
        return None


def test_missing_client_internals_name_the_supported_versions() -> None:
    with pytest.raises(ConfigurationError) as raised:
        check_client_internals(WithoutInternals(), connected=True)
    message = str(raised.value)
    assert "_flush_pending" in message and "_flush_queue" in message
    assert "options['max_reconnect_attempts']" in message
    assert "install nats-py >= 2.7, < 3" in message


def test_the_installed_nats_py_has_what_publish_writes_through() -> None:
    check_client_internals(Client())
    PublishEvent("nats://127.0.0.1:1", stream="EVENTS")  # checks at construction: no error
