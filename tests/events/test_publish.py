"""PublishEvent against a real nats-server: once per key, outcomes, validation, checks."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from datetime import UTC, datetime, timedelta
from typing import Any

import nats.js.errors
import pytest

import outbox
from effects.nats import PublishEvent, _api_outcome, canonical_json, subject_matches
from effects.testing import NatsServer
from tests.crash.support import wait_until

from .support import add_stream, delete_stream, make_job, messages, per_key, run

DATA = {"order": 102, "total": {"currency": "eur", "amount": 2000}, "items": ["tea"]}


def event(stream: str, **changes: Any) -> dict[str, Any]:
    payload: dict[str, Any] = {"subject": f"{stream}.orders.paid", "data": DATA}
    payload.update(changes)
    return payload


def test_publishes_once_with_the_key_as_message_id(
    nats_server: NatsServer, stream: str, publisher: PublishEvent
) -> None:
    first_attempt = datetime(2026, 12, 3, 5, 0, tzinfo=UTC)
    job = make_job("evt-102", event(stream, headers={"x-tenant": "t1"}),
                   first_attempted_at=first_attempt, ordering_key="order-102")

    result = run(publisher.perform(job))

    assert result == {"stream": stream, "seq": 1, "duplicate": False}
    [stored] = messages(nats_server.url, stream)
    assert stored.subject == f"{stream}.orders.paid"
    assert stored.data == canonical_json(DATA)
    assert json.loads(stored.data) == DATA
    assert stored.headers["Nats-Msg-Id"] == stored.headers["Outbox-Message-Id"] == "evt-102"
    assert stored.headers["Outbox-Event-Time"] == "2026-12-03T05:00:00.000000+00:00"
    assert stored.headers["Outbox-Ordering-Key"] == "order-102"
    assert stored.headers["x-tenant"] == "t1"


def test_a_repeat_is_dropped_by_the_broker_and_reported_as_duplicate(
    nats_server: NatsServer, stream: str, publisher: PublishEvent
) -> None:
    job = make_job("evt-102", event(stream))
    first = run(publisher.perform(job))
    retry = make_job("evt-102", event(stream), attempt=2, first_attempted_at=job.first_attempted_at)

    again = run(publisher.perform(retry))

    assert again == {"stream": stream, "seq": first["seq"], "duplicate": True}
    assert per_key(nats_server.url, stream) == {"evt-102": 1}


def test_every_attempt_publishes_the_same_bytes_whatever_the_key_order(
    nats_server: NatsServer, stream: str, publisher: PublishEvent
) -> None:
    shuffled = {"total": {"amount": 2000, "currency": "eur"}, "items": ["tea"], "order": 102}
    run(publisher.perform(make_job("evt-a", event(stream))))
    run(publisher.perform(make_job("evt-b", event(stream, data=shuffled))))

    first, second = messages(nats_server.url, stream)
    assert first.data == second.data


def test_perform_can_be_awaited_from_different_event_loops(
    nats_server: NatsServer, stream: str, publisher: PublishEvent
) -> None:
    # Each run() is a new loop; the connection lives on the effect's own loop.
    for n in range(3):
        run(publisher.perform(make_job(f"evt-{n}", event(stream))))

    assert per_key(nats_server.url, stream) == {"evt-0": 1, "evt-1": 1, "evt-2": 1}


def test_concurrent_publishes_share_the_running_loops_connection(
    nats_server: NatsServer, stream: str, publisher: PublishEvent
) -> None:
    async def scenario() -> tuple[list[dict[str, Any]], int]:
        results = await asyncio.gather(*(
            publisher.perform(make_job(f"evt-{n}", event(stream))) for n in range(50)))
        return results, len(publisher._by_loop)

    results, connections = run(scenario())

    assert connections == 1  # every publish in flight on the one connection of the loop
    assert sorted(r["seq"] for r in results) == list(range(1, 51))
    assert per_key(nats_server.url, stream) == {f"evt-{n}": 1 for n in range(50)}
    assert not publisher.connected  # closed when its loop shut down


def test_trace_headers_are_added_to_each_attempt(nats_server: NatsServer, stream: str) -> None:
    def trace(job: outbox.Job) -> dict[str, str]:
        return {"traceparent": f"00-{'1' * 32}-{job.attempt:016x}-01"}

    with PublishEvent(nats_server.url, stream, trace_headers=trace) as publisher:
        run(publisher.perform(make_job("evt-t", event(stream))))

    [stored] = messages(nats_server.url, stream)
    assert stored.headers["traceparent"] == f"00-{'1' * 32}-{1:016x}-01"


# -- invalid payloads: Permanent, before any network call ------------------------------


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"data": 1}, "subject"),
        ({"subject": "", "data": 1}, "subject"),
        ({"subject": "orders..paid", "data": 1}, "subject"),
        ({"subject": "orders.*", "data": 1}, "subject"),
        ({"subject": "orders.>", "data": 1}, "subject"),
        ({"subject": "orders paid", "data": 1}, "subject"),
        ({"subject": "$JS.API.STREAM.DELETE.EVENTS", "data": 1}, "subject"),
        ({"subject": "_INBOX.x", "data": 1}, "subject"),
        ({"subject": "orders.paid"}, "data"),
        ({"subject": "orders.paid", "data": math.nan}, "data"),
        ({"subject": "orders.paid", "data": 1, "headers": {"Nats-Msg-Id": "x"}}, "headers"),
        ({"subject": "orders.paid", "data": 1, "headers": {"outbox-message-id": "x"}},
         "headers"),
        ({"subject": "orders.paid", "data": 1, "headers": {"a:b": "x"}}, "headers"),
        ({"subject": "orders.paid", "data": 1, "headers": {"x": "a\r\nb"}}, "headers"),
        ({"subject": "orders.paid", "data": 1, "extra": True}, "extra"),
    ],
)
def test_an_invalid_payload_is_permanent_before_any_network_call(
    payload: dict[str, Any], field: str
) -> None:
    # Nothing listens on port 9: a network call would give Retry, not Permanent.
    with (
        PublishEvent("nats://127.0.0.1:9", "EVENTS") as publisher,
        pytest.raises(outbox.Permanent) as caught,
    ):
        run(publisher.perform(make_job("evt-bad", payload)))

    assert field in caught.value.reason
    assert "evt-bad" in caught.value.reason


def test_a_subject_outside_the_stream_is_permanent(
    nats_server: NatsServer, stream: str, publisher: PublishEvent
) -> None:
    with pytest.raises(outbox.Permanent, match="not one of the stream's subjects"):
        run(publisher.perform(make_job("evt-x", {"subject": "elsewhere.paid", "data": 1})))

    assert messages(nats_server.url, stream) == []


def test_a_message_over_the_streams_size_limit_is_permanent(nats_server: NatsServer) -> None:
    name = add_stream(nats_server.url, duplicate_window=120.0, max_msg_size=64)
    try:
        with PublishEvent(nats_server.url, name) as publisher, pytest.raises(
            outbox.Permanent, match="JetStream answered 400"
        ):
            run(publisher.perform(make_job("evt-big", event(name, data="x" * 100))))
        assert messages(nats_server.url, name) == []
    finally:
        delete_stream(nats_server.url, name)


def test_a_message_over_the_servers_max_payload_is_permanent(
    stream: str, publisher: PublishEvent
) -> None:
    with pytest.raises(outbox.Permanent, match="max_payload"):
        run(publisher.perform(make_job("evt-huge", event(stream, data="x" * 2_000_000))))


# -- the broker unavailable ------------------------------------------------------------


def test_a_broker_that_cannot_be_reached_is_retried() -> None:
    with PublishEvent("nats://127.0.0.1:9", "EVENTS") as publisher, pytest.raises(
        outbox.Retry, match="could not connect"
    ):
        run(publisher.perform(make_job("evt-1", event("EVENTS"))))


def test_no_responders_is_retried(nats_server: NatsServer, publisher: PublishEvent) -> None:
    # The stream disappears after the effect checked it: nobody answers the subject.
    name = publisher.stream
    run(publisher.perform(make_job("evt-1", event(name))))
    delete_stream(nats_server.url, name)
    try:
        with pytest.raises(outbox.Retry, match="no responders"):
            run(publisher.perform(make_job("evt-2", event(name))))
    finally:
        add_stream(nats_server.url, name, duplicate_window=120.0)  # for the fixture


def test_a_stopped_broker_is_retried_and_a_restarted_one_takes_the_event() -> None:
    with NatsServer() as server:
        name = add_stream(server.url, duplicate_window=120.0)
        with PublishEvent(server.url, name, timeout=2.0) as publisher:

            async def scenario() -> None:  # one loop, as a dispatcher's: one connection
                await publisher.perform(make_job("evt-1", event(name)))
                await asyncio.to_thread(server.stop)
                # Until the client has seen the connection close, a publish would be
                # written into it and time out (UnknownOutcome): wait for it to know.
                await asyncio.to_thread(wait_until, lambda: not publisher.connected,
                                        "the publisher to see the broker go")
                with pytest.raises(outbox.Retry, match="not connected|could not connect"):
                    await publisher.perform(make_job("evt-2", event(name)))
                await asyncio.to_thread(server.start)
                await asyncio.to_thread(wait_until, lambda: publisher.connected,
                                        "the publisher to reconnect")
                await publisher.perform(make_job("evt-2", event(name), attempt=2))

            run(scenario())

        assert per_key(server.url, name) == {"evt-1": 1, "evt-2": 1}


def test_a_timeout_after_the_request_was_written_is_unknown_and_the_retry_dedups() -> None:
    keys = [f"evt-{n}" for n in range(1, 4)]
    with NatsServer() as server:
        name = add_stream(server.url, duplicate_window=120.0)
        with PublishEvent(server.url, name, timeout=0.5) as publisher:

            async def scenario() -> list[dict[str, Any]]:
                # Connected and checked on this loop before the broker freezes.
                await publisher.perform(make_job("evt-0", event(name)))
                # Every thread of the server stopped: the requests are written, no answer.
                server.freeze()
                try:
                    # Several in flight at once: each times out on its own.
                    timed_out = await asyncio.gather(*(
                        publisher.perform(make_job(key, event(name))) for key in keys),
                        return_exceptions=True)
                finally:
                    server.thaw()
                assert all(isinstance(e, outbox.UnknownOutcome) for e in timed_out), timed_out
                assert all("TimeoutError" in str(e) for e in timed_out), timed_out
                return await asyncio.gather(*(
                    publisher.perform(make_job(key, event(name), attempt=2)) for key in keys))

            again = run(scenario())

        # The frozen server stored the first requests once it woke: the retries were repeats.
        assert [result["duplicate"] for result in again] == [True] * len(keys)
        assert per_key(server.url, name) == {"evt-0": 1, **{key: 1 for key in keys}}


# -- the duplicate window --------------------------------------------------------------


def test_a_re_attempt_past_the_window_publishes_nothing_and_is_unknown(
    nats_server: NatsServer, stream: str, publisher: PublishEvent
) -> None:
    late = make_job("evt-late", event(stream), attempt=2,
                    first_attempted_at=datetime.now(UTC) - timedelta(seconds=150))

    with pytest.raises(outbox.UnknownOutcome, match="past the stream's duplicate window"):
        run(publisher.perform(late))

    assert messages(nats_server.url, stream) == []
    assert publisher.unknown_outcome_window == 120.0


def test_a_first_attempt_is_never_held_back_by_the_window(
    nats_server: NatsServer, stream: str, publisher: PublishEvent
) -> None:
    first = make_job("evt-1", event(stream), first_attempted_at=datetime(2020, 1, 1, tzinfo=UTC))

    assert run(publisher.perform(first))["duplicate"] is False


# -- helpers ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "subject", "matches"),
    [
        ("a.>", "a.b", True), ("a.>", "a.b.c", True), ("a.>", "a", False),
        ("a.*", "a.b", True), ("a.*", "a.b.c", False), ("a.b", "a.b", True),
        ("a.b", "a.c", False), ("*.b", "x.b", True), (">", "x", True),
    ],
)
def test_subject_matching_follows_nats_wildcards(pattern: str, subject: str,
                                                 matches: bool) -> None:
    assert subject_matches(pattern, subject) is matches


def test_credentials_in_server_urls_reach_no_reason_log_or_repr(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    with PublishEvent("nats://alice:s3cr3t-pw@127.0.0.1:9", "EVENTS") as publisher:
        with pytest.raises(outbox.Retry) as caught:
            run(publisher.perform(make_job("evt-1", event("EVENTS"))))
        shown = repr(publisher)

    texts = [shown, str(caught.value), *(r.getMessage() for r in caplog.records)]
    assert not [text for text in texts if "s3cr3t-pw" in text]
    assert "127.0.0.1:9" in caught.value.reason


@pytest.mark.parametrize(
    ("code", "err_code", "outcome"),
    [(503, 10039, outbox.Retry), (400, 10060, outbox.Permanent),
     (404, 10059, outbox.Permanent), (500, 10049, outbox.UnknownOutcome)],
)
def test_jetstream_answers_map_to_outcomes(
    code: int, err_code: int, outcome: type[outbox.EffectOutcome]
) -> None:
    with pytest.raises(nats.js.errors.APIError) as answer:  # nats-py raises what it parses
        nats.js.errors.APIError.from_error(
            {"code": code, "err_code": err_code, "description": "as the server says"})

    mapped = _api_outcome(answer.value, "nats.publish job k")

    assert type(mapped) is outcome
    assert f"err_code {err_code}: as the server says" in str(mapped)
