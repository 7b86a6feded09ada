"""The shipped HTTP adapters honour ``job.cancelled``: a job told to stop sends nothing
more to the provider (the real fakes count every request), and says so with ``Retry``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import outbox
from effects import ChargeCard, PostWebhook, SendEmail
from effects.testing import FakeEmailProvider, FakeStripe, FakeWebhookReceiver

from ._support import charge_payload, email_payload, make_job


def _told(job: outbox.Job) -> outbox.Job:
    job.cancelled.set()
    return job


def test_an_email_job_told_to_stop_sends_nothing(
        resend: FakeEmailProvider, send_email: SendEmail) -> None:
    with pytest.raises(outbox.Retry, match="told to stop .*nothing sent"):
        send_email.perform(_told(make_job("email.send", "email-1", email_payload())))
    assert resend.requests("email-1") == 0
    send_email.perform(make_job("email.send", "email-1", email_payload()))  # untold: sent
    assert resend.performed("email-1") == 1


def test_a_charge_told_to_stop_reaches_no_stripe_endpoint(
        stripe_fake: FakeStripe, charge_card: ChargeCard) -> None:
    with pytest.raises(outbox.Retry, match="told to stop"):
        charge_card.perform(_told(make_job("payment.charge", "pay-1", charge_payload())))
    assert stripe_fake.requests("pay-1") == 0
    assert charge_card.perform(make_job("payment.charge", "pay-1", charge_payload()))["id"]
    assert stripe_fake.performed("pay-1") == 1


def test_a_webhook_told_to_stop_is_not_delivered(
        receiver: FakeWebhookReceiver, post_webhook: PostWebhook) -> None:
    payload: dict[str, Any] = {"event": "order.paid", "data": {"order": 1}}
    with pytest.raises(outbox.Retry, match="told to stop"):
        post_webhook.perform(_told(make_job("webhook.post", "hook-1", payload)))
    assert receiver.received == []
    post_webhook.perform(make_job("webhook.post", "hook-1", payload))
    assert len(receiver.received) == 1


@pytest.mark.parametrize("tell", [lambda job: job.cancelled.set(),
                                  lambda job: job.cancelled.tell("operator")])
def test_the_reason_told_is_named(resend: FakeEmailProvider, send_email: SendEmail,
                                  tell: Callable[[outbox.Job], None]) -> None:
    job = make_job("email.send", "email-2", email_payload())
    tell(job)
    with pytest.raises(outbox.Retry) as raised:
        send_email.perform(job)
    assert str(job.cancelled.reason) in str(raised.value)  # type: ignore[attr-defined]
