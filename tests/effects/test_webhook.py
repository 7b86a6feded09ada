"""PostWebhook against FakeWebhookReceiver over real HTTP, and the signature helpers."""

from __future__ import annotations

import base64
import math
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

import pytest
import standardwebhooks

import outbox
from effects import (
    PostWebhook,
    compute_signature,
    generate_secret,
    verify_headers,
    verify_signature,
)
from effects.testing import FakeWebhookReceiver

from ._support import TIMEOUT, WEBHOOK_SECRET, LibraryReceiver, make_job

WEBHOOK_SECRET_B64 = WEBHOOK_SECRET

KEY = "webhook-order-102"
DATA = {"order": 102, "total": {"amount": 2000, "currency": "eur"}, "items": ["tea"]}


def webhook_job(key: str = KEY, **payload: Any) -> outbox.Job:
    return make_job("webhook.post", key, {"event": "order.paid", "data": DATA, **payload})


def test_delivers_a_signed_event_once(
    receiver: FakeWebhookReceiver, post_webhook: PostWebhook
) -> None:
    result = post_webhook.perform(webhook_job())

    assert result == {"status": 200}
    [event] = receiver.received  # the receiver checked the signature before accepting
    assert (event.key, event.event, event.data) == (KEY, "order.paid", DATA)


def test_a_redelivery_sends_the_same_body_and_is_deduplicated(
    receiver: FakeWebhookReceiver, post_webhook: PostWebhook
) -> None:
    post_webhook.perform(webhook_job())
    post_webhook.perform(webhook_job())

    # Had the body differed, the receiver would have answered 422 and we would raise.
    assert receiver.performed(KEY) == 1
    assert receiver.requests(KEY) == 2


def test_a_wrong_secret_is_permanent(receiver: FakeWebhookReceiver) -> None:
    with (
        PostWebhook(url=receiver.url, secret="whsec_d3Jvbmc=", timeout=TIMEOUT) as adapter,
        pytest.raises(outbox.Permanent, match="HTTP 401"),
    ):
        adapter.perform(webhook_job())

    assert receiver.received == []


def test_in_flight_key_is_retried(
    receiver: FakeWebhookReceiver, post_webhook: PostWebhook
) -> None:
    hold = receiver.hold_next()
    with ThreadPoolExecutor(max_workers=1) as pool:
        first = pool.submit(post_webhook.perform, webhook_job())
        hold.wait_for_arrival()
        with pytest.raises(outbox.Retry, match="HTTP 409"):
            post_webhook.perform(webhook_job())
        hold.release()
        assert first.result(timeout=TIMEOUT) == {"status": 200}

    assert receiver.performed(KEY) == 1


def test_a_key_reused_with_other_data_is_permanent(
    receiver: FakeWebhookReceiver, post_webhook: PostWebhook
) -> None:
    post_webhook.perform(webhook_job())

    with pytest.raises(outbox.Permanent, match="HTTP 422"):
        post_webhook.perform(webhook_job(data={"order": 103}))


@pytest.mark.parametrize("status", [429, 503])
def test_load_refusals_are_throttled(
    receiver: FakeWebhookReceiver, post_webhook: PostWebhook, status: int
) -> None:
    receiver.fail_next(1, status, retry_after=2)

    with pytest.raises(outbox.Throttled, match=f"HTTP {status}") as caught:
        post_webhook.perform(webhook_job())

    assert caught.value.after == 2.0
    assert receiver.performed(KEY) == 0


@pytest.mark.parametrize("status", [408, 425, 500, 502])
def test_transient_statuses_are_retried(
    receiver: FakeWebhookReceiver, post_webhook: PostWebhook, status: int
) -> None:
    receiver.fail_next(1, status, retry_after=2)

    with pytest.raises(outbox.Retry, match=f"HTTP {status}") as caught:
        post_webhook.perform(webhook_job())

    assert caught.value.after == 2.0
    assert receiver.performed(KEY) == 0


@pytest.mark.parametrize("status", [301, 400, 403, 404, 410])
def test_other_statuses_are_permanent(
    receiver: FakeWebhookReceiver, post_webhook: PostWebhook, status: int
) -> None:
    receiver.fail_next(1, status)

    with pytest.raises(outbox.Permanent, match=f"receiver answered HTTP {status}") as caught:
        post_webhook.perform(webhook_job())

    assert KEY in caught.value.reason
    assert "127.0.0.1" in caught.value.reason


def test_a_timeout_after_sending_is_unknown(
    receiver: FakeWebhookReceiver, impatient_post_webhook: PostWebhook
) -> None:
    receiver.succeed_then_timeout()

    with pytest.raises(outbox.UnknownOutcome, match="ReadTimeout"):
        impatient_post_webhook.perform(webhook_job())
    impatient_post_webhook.perform(webhook_job())

    assert receiver.performed(KEY) == 1


@pytest.mark.parametrize("fault", ["succeed_then_drop", "drop_connection"])
def test_a_dropped_connection_is_unknown(
    receiver: FakeWebhookReceiver, post_webhook: PostWebhook, fault: str
) -> None:
    getattr(receiver, fault)()

    with pytest.raises(outbox.UnknownOutcome):
        post_webhook.perform(webhook_job())
    post_webhook.perform(webhook_job())

    assert receiver.performed(KEY) == 1


def test_a_refused_connection_is_retried(refused_url: str) -> None:
    with (
        PostWebhook(url=refused_url + "/hook", secret=WEBHOOK_SECRET) as adapter,
        pytest.raises(outbox.Retry, match="could not connect"),
    ):
        adapter.perform(webhook_job())


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"event": ""}, "event"),
        ({"data": None, "extra": 1}, "extra"),
        ({"data": math.nan}, "data"),
    ],
)
def test_an_invalid_payload_is_permanent_and_names_the_field(
    receiver: FakeWebhookReceiver, post_webhook: PostWebhook, payload: dict[str, Any], field: str
) -> None:
    with pytest.raises(outbox.Permanent) as caught:
        post_webhook.perform(webhook_job(**payload))

    assert field in caught.value.reason
    assert receiver.total_requests == 0


def test_a_missing_data_field_is_refused(post_webhook: PostWebhook) -> None:
    job = make_job("webhook.post", KEY, {"event": "order.paid"})

    with pytest.raises(outbox.Permanent, match="data: Field required"):
        post_webhook.perform(job)


# -- signatures ----------------------------------------------------------------------

BODY = b'{"data":{},"event":"order.paid","id":"k"}'
NOW = 1_700_000_000
SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
OTHER = "whsec_c2VjcmV0LWItcm90YXRlZA=="


def test_a_signature_verifies_for_its_id_body_and_time() -> None:
    signature = compute_signature(SECRET, "k", NOW, BODY)

    assert signature.startswith("v1,")
    assert verify_signature(SECRET, "k", str(NOW), BODY, signature, now=NOW + 10)
    assert verify_signature(SECRET, "k", NOW, BODY.decode(), signature, now=NOW)


@pytest.mark.parametrize(
    ("secret", "msg_id", "timestamp", "body", "now"),
    [
        (OTHER, "k", str(NOW), BODY, NOW),  # wrong secret
        (SECRET, "k2", str(NOW), BODY, NOW),  # another id
        (SECRET, "", str(NOW), BODY, NOW),  # no id
        (SECRET, "k", str(NOW), BODY + b" ", NOW),  # body changed
        (SECRET, "k", str(NOW + 1), BODY, NOW),  # timestamp changed
        (SECRET, "k", str(NOW), BODY, NOW + 301),  # too old
        (SECRET, "k", str(NOW), BODY, NOW - 301),  # too far ahead
        (SECRET, "k", "not-a-time", BODY, NOW),
        (SECRET, "k", "", BODY, NOW),
    ],
)
def test_a_signature_fails_when_anything_differs(
    secret: str, msg_id: str, timestamp: str, body: bytes, now: int
) -> None:
    signature = compute_signature(SECRET, "k", NOW, BODY)

    assert not verify_signature(secret, msg_id, timestamp, body, signature, now=now)


def test_any_of_several_signatures_may_match() -> None:
    rotated = f"v1,ZGVhZGJlZWY= {compute_signature(SECRET, 'k', NOW, BODY)}"

    assert verify_signature(SECRET, "k", NOW, BODY, rotated, now=NOW)
    assert verify_signature([OTHER, SECRET], "k", NOW, BODY, rotated, now=NOW)
    assert not verify_signature(SECRET, "k", NOW, BODY, "v0,abc v1, v1,!!", now=NOW)


def test_signing_with_two_secrets_satisfies_holders_of_either() -> None:
    both = compute_signature([SECRET, OTHER], "k", NOW, BODY)

    assert len(both.split(" ")) == 2
    assert verify_signature(SECRET, "k", NOW, BODY, both, now=NOW)
    assert verify_signature(OTHER, "k", NOW, BODY, both, now=NOW)


@pytest.mark.parametrize("secret", ["whsec_", "whsec_not base64!", "", b""])
def test_a_malformed_secret_is_refused_without_repeating_it(secret: str | bytes) -> None:
    with pytest.raises(ValueError) as caught:
        compute_signature(secret, "k", NOW, BODY)

    assert "not base64!" not in str(caught.value)


def test_raw_bytes_and_unpadded_base64_are_the_same_key() -> None:
    key = b"0123456789abcdef"
    padded = "whsec_" + base64.b64encode(key).decode()

    assert compute_signature(key, "k", NOW, BODY) == compute_signature(padded, "k", NOW, BODY)
    assert compute_signature(padded.rstrip("="), "k", NOW, BODY) == compute_signature(
        key, "k", NOW, BODY
    )


def test_verify_headers_returns_the_verified_id() -> None:
    headers = {
        "Webhook-Id": "k",
        "Webhook-Timestamp": str(NOW),
        "Webhook-Signature": compute_signature(SECRET, "k", NOW, BODY),
    }

    assert verify_headers(SECRET, headers, BODY, now=NOW) == "k"
    assert verify_headers(OTHER, headers, BODY, now=NOW) is None
    assert verify_headers(SECRET, {**headers, "Webhook-Id": "k2"}, BODY, now=NOW) is None


# -- interoperability with the standardwebhooks library -------------------------------


def test_generated_secrets_work_with_the_standardwebhooks_library() -> None:
    secret = generate_secret()
    sent = compute_signature(secret, "k", NOW, BODY)

    assert secret.startswith("whsec_")
    assert standardwebhooks.Webhook(secret).sign("k", datetime.fromtimestamp(NOW, UTC),
                                                 BODY.decode()) == sent


def test_the_standardwebhooks_library_verifies_what_post_webhook_sends() -> None:
    library = standardwebhooks.Webhook(WEBHOOK_SECRET_B64)
    with LibraryReceiver(library) as server, PostWebhook(
        url=server.url, secret=[WEBHOOK_SECRET_B64, OTHER], timeout=TIMEOUT
    ) as adapter:
        assert adapter.perform(webhook_job()) == {"status": 200}
        adapter.perform(webhook_job())  # a redelivery: same id and body, fresh signature

    first, second = server.verified
    assert first == second == {"id": KEY, "event": "order.paid", "data": DATA}
    assert server.ids == [KEY, KEY]


def test_post_webhook_is_verified_by_a_receiver_holding_only_the_new_secret() -> None:
    library = standardwebhooks.Webhook(OTHER)
    with LibraryReceiver(library) as server, PostWebhook(
        url=server.url, secret=[WEBHOOK_SECRET_B64, OTHER], timeout=TIMEOUT
    ) as adapter:
        adapter.perform(webhook_job())

    assert server.ids == [KEY]


def test_verify_headers_accepts_what_the_standardwebhooks_library_signs() -> None:
    library = standardwebhooks.Webhook(SECRET)
    stamp = int(time.time())
    headers = {
        "webhook-id": "msg_1",
        "webhook-timestamp": str(stamp),
        "webhook-signature": library.sign("msg_1", datetime.fromtimestamp(stamp, UTC),
                                          BODY.decode()),
    }

    assert verify_headers(SECRET, headers, BODY) == "msg_1"
