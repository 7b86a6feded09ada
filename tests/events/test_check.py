"""PublishEvent.check: streams that cannot keep the once-per-key promise are refused."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from nats.js.api import DiscardPolicy, RetentionPolicy

import outbox
from effects.nats import PublishEvent
from effects.testing import NatsServer
from tests.crash.support import wait_until

from .support import add_stream, delete_stream, make_job, per_key, run


@pytest.fixture
def made(nats_server: NatsServer) -> Iterator[list[str]]:
    """Streams a test creates, deleted afterwards."""
    names: list[str] = []
    yield names
    for name in names:
        delete_stream(nats_server.url, name)


def stream_with(nats_server: NatsServer, made: list[str], **config: Any) -> str:
    name = add_stream(nats_server.url, **config)
    made.append(name)
    return name


def test_a_fit_stream_passes_and_gives_its_window(
    nats_server: NatsServer, made: list[str]
) -> None:
    name = stream_with(nats_server, made, duplicate_window=600.0)
    with PublishEvent(nats_server.url, name, lease=30, rescue_interval=5) as publisher:
        facts = publisher.check()

        assert (facts.window, facts.subjects, facts.strict) == (600.0, (f"{name}.>",), False)
        assert publisher.unknown_outcome_window == 600.0


def test_a_missing_stream_is_refused(nats_server: NatsServer) -> None:
    with (
        PublishEvent(nats_server.url, "NOSUCHSTREAM") as publisher,
        pytest.raises(outbox.ConfigurationError, match="'NOSUCHSTREAM' does not exist"),
    ):
        publisher.check()


def test_a_window_shorter_than_a_reclaim_is_refused_naming_the_setting(
    nats_server: NatsServer, made: list[str]
) -> None:
    name = stream_with(nats_server, made, duplicate_window=20.0)
    with (
        PublishEvent(nats_server.url, name, lease=30, rescue_interval=5) as publisher,
        pytest.raises(outbox.ConfigurationError) as caught,
    ):
        publisher.check()

    assert "20 s (duplicate_window)" in str(caught.value)
    assert "35 s" in str(caught.value)
    assert "--dupe-window" in str(caught.value)


def test_a_short_max_age_caps_the_window(nats_server: NatsServer, made: list[str]) -> None:
    name = stream_with(nats_server, made, duplicate_window=10.0, max_age=10.0)
    with (
        PublishEvent(nats_server.url, name, lease=30, rescue_interval=5) as publisher,
        pytest.raises(outbox.ConfigurationError, match="remembers message ids for 10 s"),
    ):
        publisher.check()


@pytest.mark.parametrize("retention", [RetentionPolicy.WORK_QUEUE, RetentionPolicy.INTEREST])
def test_a_retention_that_forgets_ids_is_refused(
    nats_server: NatsServer, made: list[str], retention: RetentionPolicy
) -> None:
    name = stream_with(nats_server, made, duplicate_window=120.0, retention=retention)
    with (
        PublishEvent(nats_server.url, name) as publisher,
        pytest.raises(outbox.ConfigurationError, match="use retention=limits"),
    ):
        publisher.check()


def test_an_unfit_stream_met_on_first_use_retries_the_job(
    nats_server: NatsServer, made: list[str]
) -> None:
    name = stream_with(nats_server, made, duplicate_window=120.0,
                       retention=RetentionPolicy.WORK_QUEUE)
    with (
        PublishEvent(nats_server.url, name) as publisher,
        pytest.raises(outbox.Retry, match="stream unfit"),
    ):
        run(publisher.perform(make_job("evt-1", {"subject": f"{name}.a", "data": 1})))

    assert per_key(nats_server.url, name) == {}


def test_an_unreachable_broker_fails_check_with_a_connection_error() -> None:
    with (
        PublishEvent("nats://user:pa55word@127.0.0.1:9", "EVENTS") as publisher,
        pytest.raises(ConnectionError) as caught,
    ):
        publisher.check()

    assert "pa55word" not in str(caught.value)
    assert "127.0.0.1:9" in str(caught.value)


# -- strict mode -----------------------------------------------------------------------


def strict_stream(nats_server: NatsServer, made: list[str], **config: Any) -> str:
    return stream_with(nats_server, made, duplicate_window=60.0, max_msgs_per_subject=1,
                       discard=DiscardPolicy.NEW, discard_new_per_subject=True, **config)


def test_strict_mode_needs_one_message_per_subject(
    nats_server: NatsServer, made: list[str]
) -> None:
    name = stream_with(nats_server, made, duplicate_window=120.0)
    with (
        PublishEvent(nats_server.url, name, strict=True) as publisher,
        pytest.raises(outbox.ConfigurationError, match="max_msgs_per_subject=1"),
    ):
        publisher.check()


def test_strict_mode_republishes_past_the_window_and_the_broker_refuses_the_repeat(
    nats_server: NatsServer, made: list[str]
) -> None:
    name = strict_stream(nats_server, made)
    payload = {"subject": f"{name}.orders.102.paid", "data": {"order": 102}}
    with PublishEvent(nats_server.url, name, strict=True) as publisher:
        first = run(publisher.perform(make_job("evt-102", payload)))
        late = make_job("evt-102", payload, attempt=3,
                        first_attempted_at=datetime.now(UTC) - timedelta(hours=2))
        # Past the window the id is no defence; the subject already holding it is.
        again = run(publisher.perform(late))
        assert publisher.unknown_outcome_window == 24 * 3600.0

    assert again == {"stream": name, "seq": first["seq"], "duplicate": True}
    assert per_key(nats_server.url, name) == {"evt-102": 1}


def test_strict_mode_refuses_a_second_event_on_a_taken_subject(
    nats_server: NatsServer, made: list[str]
) -> None:
    name = strict_stream(nats_server, made)
    payload = {"subject": f"{name}.orders.paid", "data": 1}
    with PublishEvent(nats_server.url, name, strict=True) as publisher:
        run(publisher.perform(make_job("evt-a", payload)))
        with pytest.raises(outbox.Permanent, match="each event needs its own subject"):
            run(publisher.perform(make_job("evt-b", payload)))

    assert per_key(nats_server.url, name) == {"evt-a": 1}


def test_strict_mode_finds_its_own_event_once_the_broker_forgot_the_id(
    nats_server: NatsServer, made: list[str]
) -> None:
    name = stream_with(nats_server, made, duplicate_window=1.0, max_msgs_per_subject=1,
                       discard=DiscardPolicy.NEW, discard_new_per_subject=True)
    payload = {"subject": f"{name}.orders.102.paid", "data": {"order": 102}}
    with PublishEvent(nats_server.url, name, strict=True, lease=0.5,
                      rescue_interval=0.1) as publisher:
        first = run(publisher.perform(make_job("evt-102", payload)))
        # The window is a duration: no event marks its end, so wait it out.
        forgotten_at = time.monotonic() + 1.5
        wait_until(lambda: time.monotonic() > forgotten_at, "the duplicate window to pass")
        again = run(publisher.perform(make_job("evt-102", payload, attempt=2)))

    # The broker refused the repeat (10077); the effect found the stored one by subject.
    assert again == {"stream": name, "seq": first["seq"], "duplicate": True}
    assert per_key(nats_server.url, name) == {"evt-102": 1}
