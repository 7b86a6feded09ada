"""SendEmail against FakeEmailProvider over real HTTP: every row of its outcome table."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

import outbox
from effects import EmailPayload, SendEmail
from effects.testing import FakeEmailProvider

from ._support import RESEND_KEY, TIMEOUT, email_payload, make_job

KEY = "email-order-102"


def email_job(key: str = KEY, **changes: Any) -> outbox.Job:
    return make_job("email.send", key, email_payload(**changes))


def test_sends_once_and_returns_the_resend_id(
    resend: FakeEmailProvider, send_email: SendEmail
) -> None:
    result = send_email.perform(email_job())

    [sent] = resend.sent_emails
    assert result == {"id": sent.id}
    assert sent.key == KEY  # the job key, unchanged, is the Idempotency-Key
    assert sent.message == email_payload()
    assert json.loads(json.dumps(result)) == result  # fit for the ledger


def test_a_retry_with_the_same_key_is_replayed_not_sent_again(
    resend: FakeEmailProvider, send_email: SendEmail
) -> None:
    first = send_email.perform(email_job())
    second = send_email.perform(email_job())

    assert second == first
    assert resend.performed(KEY) == 1
    assert resend.requests(KEY) == 2


def test_uses_the_model_the_dispatcher_validated(
    resend: FakeEmailProvider, send_email: SendEmail
) -> None:
    model = EmailPayload.model_validate(email_payload(subject="From the model"))
    job = make_job("email.send", KEY, email_payload(), model=model)

    send_email.perform(job)

    assert resend.sent_emails[0].message["subject"] == "From the model"


def test_optional_fields_go_out_with_resend_names(
    resend: FakeEmailProvider, send_email: SendEmail
) -> None:
    extras: dict[str, Any] = {
        "html": "<p>Thanks</p>",
        "cc": "shop@shop.example",
        "bcc": ["audit@shop.example"],
        "reply_to": "help@shop.example",
        "tags": [{"name": "category", "value": "order_confirmation"}],
    }

    send_email.perform(email_job(**extras))

    assert resend.sent_emails[0].message == email_payload(**extras)


def test_in_flight_key_is_retried(resend: FakeEmailProvider, send_email: SendEmail) -> None:
    hold = resend.hold_next()
    with ThreadPoolExecutor(max_workers=1) as pool:
        first = pool.submit(send_email.perform, email_job())
        hold.wait_for_arrival()
        with pytest.raises(outbox.Retry, match="409 concurrent_idempotent_requests"):
            send_email.perform(email_job())
        hold.release()
        result = first.result(timeout=TIMEOUT)

    assert result == {"id": resend.sent_emails[0].id}
    assert resend.performed(KEY) == 1


def test_key_reused_for_another_email_is_permanent(
    resend: FakeEmailProvider, send_email: SendEmail
) -> None:
    send_email.perform(email_job())

    with pytest.raises(outbox.Permanent, match="409 invalid_idempotent_request") as caught:
        send_email.perform(email_job(subject="Another email"))

    assert KEY in caught.value.reason
    assert resend.performed(KEY) == 1


def test_rate_limit_is_throttled_until_the_providers_delay(
    resend: FakeEmailProvider, send_email: SendEmail
) -> None:
    resend.fail_next(1, 429, retry_after=7)

    with pytest.raises(outbox.Throttled, match="429 rate_limit_exceeded") as caught:
        send_email.perform(email_job())

    assert caught.value.after == 7.0
    assert resend.performed(KEY) == 0


def test_past_resends_rate_the_429_tells_the_rate(send_email: SendEmail) -> None:
    with FakeEmailProvider(rate_limit=2.0) as limited, SendEmail(
            api_key=RESEND_KEY, base_url=limited.url, timeout=TIMEOUT) as adapter:
        adapter.perform(email_job("a"))
        adapter.perform(email_job("b"))
        with pytest.raises(outbox.Throttled) as caught:
            adapter.perform(email_job("c"))
        assert limited.performed("c") == 0
    assert caught.value.rate == 2.0
    assert caught.value.after is not None and caught.value.after >= 1.0


def test_a_503_with_retry_after_is_throttled_a_bare_503_retried(
    resend: FakeEmailProvider, send_email: SendEmail
) -> None:
    resend.set_outage(True, retry_after=3)
    with pytest.raises(outbox.Throttled) as caught:
        send_email.perform(email_job())
    assert caught.value.after == 3.0
    resend.set_outage(True)
    with pytest.raises(outbox.Retry, match="HTTP 503"):
        send_email.perform(email_job())
    resend.set_outage(False)
    send_email.perform(email_job())
    assert resend.performed(KEY) == 1
    assert resend.outage_requests == 2


@pytest.mark.parametrize("status", [500, 502, 503])
def test_server_errors_are_retried_and_a_retry_then_sends_once(
    resend: FakeEmailProvider, send_email: SendEmail, status: int
) -> None:
    resend.fail_next(1, status)

    with pytest.raises(outbox.Retry, match=f"HTTP {status}"):
        send_email.perform(email_job())
    send_email.perform(email_job())

    assert resend.performed(KEY) == 1


@pytest.mark.parametrize(
    ("status", "name"),
    [(400, "validation_error"), (404, "not_found"), (422, "validation_error")],
)
def test_other_client_errors_are_permanent_with_status_and_name(
    resend: FakeEmailProvider, send_email: SendEmail, status: int, name: str
) -> None:
    resend.fail_next(1, status, error=name)

    with pytest.raises(outbox.Permanent) as caught:
        send_email.perform(email_job())

    assert f"HTTP {status} {name}: injected failure" in caught.value.reason
    assert KEY in caught.value.reason


def test_a_wrong_api_key_is_permanent(resend: FakeEmailProvider) -> None:
    with (
        SendEmail(api_key="re_wrong", base_url=resend.url, timeout=TIMEOUT) as adapter,
        pytest.raises(outbox.Permanent, match="HTTP 403 invalid_api_key"),
    ):
        adapter.perform(email_job())


def test_a_timeout_after_sending_is_unknown_and_the_retry_is_deduplicated(
    resend: FakeEmailProvider, impatient_send_email: SendEmail
) -> None:
    resend.succeed_then_timeout()

    with pytest.raises(outbox.UnknownOutcome, match="ReadTimeout"):
        impatient_send_email.perform(email_job())
    result = impatient_send_email.perform(email_job())

    assert result == {"id": resend.sent_emails[0].id}
    assert resend.performed(KEY) == 1


def test_a_connection_dropped_after_sending_is_unknown(
    resend: FakeEmailProvider, send_email: SendEmail
) -> None:
    resend.succeed_then_drop()

    with pytest.raises(outbox.UnknownOutcome, match="RemoteProtocolError"):
        send_email.perform(email_job())
    send_email.perform(email_job())

    assert resend.performed(KEY) == 1


def test_a_connection_dropped_before_performing_is_unknown_too(
    resend: FakeEmailProvider, send_email: SendEmail
) -> None:
    # The client cannot tell this drop from the one above, so it must assume the worst.
    resend.drop_connection()

    with pytest.raises(outbox.UnknownOutcome):
        send_email.perform(email_job())
    send_email.perform(email_job())

    assert resend.performed(KEY) == 1


def test_a_refused_connection_is_retried(refused_url: str) -> None:
    with (
        SendEmail(api_key=RESEND_KEY, base_url=refused_url, timeout=TIMEOUT) as adapter,
        pytest.raises(outbox.Retry, match="could not connect"),
    ):
        adapter.perform(email_job())


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"subject": None}, "subject"),
        ({"from": None}, "from"),
        ({"to": []}, "to"),
        ({"to": 42}, "to"),
        ({"text": None}, "give `text` or `html`"),
        ({"tags": [{"name": "has space", "value": "x"}]}, "tags.0.name"),
        ({"attachments": []}, "attachments"),
    ],
)
def test_an_invalid_payload_is_permanent_and_names_the_field(
    resend: FakeEmailProvider, send_email: SendEmail, changes: dict[str, Any], field: str
) -> None:
    with pytest.raises(outbox.Permanent) as caught:
        send_email.perform(email_job(**changes))

    assert field in caught.value.reason
    assert "ada@example.com" not in caught.value.reason  # names fields, not contents
    assert resend.total_requests == 0


def test_the_api_key_is_sent_as_a_bearer_token_only(resend: FakeEmailProvider) -> None:
    # The fake refuses any other key with 403, so a success proves the header.
    with SendEmail(api_key=RESEND_KEY, base_url=resend.url, timeout=TIMEOUT) as adapter:
        adapter.perform(email_job())
        assert RESEND_KEY not in repr(adapter)

    assert resend.performed(KEY) == 1


def test_refuses_an_empty_api_key() -> None:
    with pytest.raises(ValueError, match="API key"):
        SendEmail(api_key="")


def test_one_adapter_serves_many_threads(resend: FakeEmailProvider, send_email: SendEmail) -> None:
    keys = [f"email-{n}" for n in range(24)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda key: send_email.perform(email_job(key)), keys))

    assert sorted(resend.performed_keys()) == sorted(keys)
    assert all(resend.performed(key) == 1 for key in keys)
    assert len({result["id"] for result in results}) == len(keys)


def test_a_payload_enqueued_as_a_model_validates_again() -> None:
    # outbox stores a model payload as model_dump(mode="json", by_alias=True).
    model = EmailPayload.model_validate(email_payload(cc=["a@b.example"]))
    stored = model.model_dump(mode="json", by_alias=True)

    assert stored["from"] == email_payload()["from"]
    assert EmailPayload.model_validate(stored) == model
