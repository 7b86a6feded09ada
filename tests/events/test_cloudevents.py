"""envelope="cloudevents": nats.publish and webhook.post messages parsed by the SDK."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import pytest
from cloudevents.core.bindings import http as ce_http
from cloudevents.core.formats.json import JSONFormat

import outbox
from effects.nats import PublishEvent
from effects.testing import NatsServer
from effects.webhook import PostWebhook, generate_secret, verify_headers

from .support import make_job, messages, run

FIRST = datetime(2026, 12, 3, 5, 0, tzinfo=UTC)


def parsed(headers: dict[str, str], body: bytes) -> Any:
    return ce_http.from_binary(ce_http.HTTPMessage(headers, body), JSONFormat())


def test_a_nats_event_is_a_binary_cloudevent_the_sdk_reads(
    nats_server: NatsServer, stream: str
) -> None:
    with PublishEvent(nats_server.url, stream, envelope="cloudevents",
                      source="/shop/orders") as publisher:
        job = make_job("evt-102", {"subject": f"{stream}.orders.paid", "data": {"order": 102}},
                       first_attempted_at=FIRST)
        run(publisher.perform(job))
        typed = make_job("evt-103", {"subject": f"{stream}.orders.paid", "data": 1,
                                     "type": "com.shop.order.paid"}, first_attempted_at=FIRST)
        run(publisher.perform(typed))

    first, second = messages(nats_server.url, stream)
    event = parsed({k.lower(): v for k, v in first.headers.items()}, first.data)
    assert (event.get_id(), event.get_source(), event.get_type()) == (
        "evt-102", "/shop/orders", f"{stream}.orders.paid")  # the subject when untyped
    assert (event.get_specversion(), event.get_time(), event.get_data()) == (
        "1.0", FIRST, {"order": 102})
    assert first.headers["Nats-Msg-Id"] == "evt-102"  # dedup by the broker still
    assert parsed({k.lower(): v for k, v in second.headers.items()},
                  second.data).get_type() == "com.shop.order.paid"


def test_ce_time_is_the_first_attempts_on_every_attempt(
    nats_server: NatsServer, stream: str
) -> None:
    first = datetime.now(UTC) - timedelta(seconds=30)  # inside the duplicate window
    with PublishEvent(nats_server.url, stream, envelope="cloudevents") as publisher:
        payload = {"subject": f"{stream}.orders.paid", "data": 1}
        run(publisher.perform(make_job("evt-a", payload, first_attempted_at=first)))
        run(publisher.perform(make_job("evt-a", payload, attempt=3, first_attempted_at=first)))
        run(publisher.perform(make_job("evt-b", payload, attempt=3, first_attempted_at=first)))

    stored = messages(nats_server.url, stream)  # evt-a's repeat dropped by the broker
    assert {m.headers["ce-time"] for m in stored} == {first.isoformat(timespec="microseconds")}
    assert sorted(m.headers["ce-id"] for m in stored) == ["evt-a", "evt-b"]


class _Capture(BaseHTTPRequestHandler):
    requests: ClassVar[list[tuple[dict[str, str], bytes]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        _Capture.requests.append(({k.lower(): v for k, v in self.headers.items()}, body))
        self.send_response(204)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[str]:
    _Capture.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Capture)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hooks"
    server.shutdown()
    server.server_close()
    thread.join()


def test_a_webhook_is_a_binary_cloudevent_and_still_signed(receiver: str) -> None:
    secret = generate_secret()
    job = outbox.Job(id=1, effect="webhook.post", key="hook-102",
                     payload={"event": "order.paid", "data": {"order": 102}}, attempt=1,
                     claim_version=1, first_attempted_at=FIRST)
    with PostWebhook(receiver, secret, envelope="cloudevents", source="/shop") as post:
        assert post.perform(job) == {"status": 204}

    [(headers, body)] = _Capture.requests
    event = parsed(headers, body)
    assert (event.get_id(), event.get_source(), event.get_type(), event.get_time()) == (
        "hook-102", "/shop", "order.paid", FIRST)
    assert event.get_data() == {"order": 102}
    verify_headers(secret, headers, body)  # the Standard Webhooks signature covers it


def test_an_unknown_envelope_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="envelope"):
        PublishEvent(envelope="structured")  # type: ignore[arg-type]
