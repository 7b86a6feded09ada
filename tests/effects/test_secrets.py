"""API keys and signing secrets never reach an outcome, an exception chain or a log."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import pytest

import outbox
from effects import ChargeCard, PostWebhook, SendEmail
from effects.testing import FakeEmailProvider, FakeStripe, FakeWebhookReceiver

from ._support import (
    RESEND_KEY,
    SECRETS,
    SHORT_TIMEOUT,
    STRIPE_KEY,
    WEBHOOK_SECRET,
    charge_payload,
    email_payload,
    make_job,
)

Scenario = Callable[[], None]


def chain(exc: BaseException) -> Iterator[BaseException]:
    seen: BaseException | None = exc
    while seen is not None:
        yield seen
        seen = seen.__cause__ or seen.__context__


def assert_no_secret(
    exc: BaseException, caplog: pytest.LogCaptureFixture, scenario: str = ""
) -> None:
    texts = [text for error in chain(exc) for text in (str(error), repr(error))]
    texts += [str(arg) for error in chain(exc) for arg in error.args]
    texts += [record.getMessage() for record in caplog.records]
    texts += [str(record.args) for record in caplog.records]
    for secret in SECRETS:
        leaks = [text for text in texts if secret in text]
        assert not leaks, f"{scenario}: secret leaked into: {leaks}"


def email_scenarios(fake: FakeEmailProvider) -> list[tuple[str, Scenario]]:
    def with_fault(arm: Callable[[], None], key: str = RESEND_KEY) -> Scenario:
        def run() -> None:
            arm()
            with SendEmail(key, base_url=fake.url, timeout=SHORT_TIMEOUT) as adapter:
                adapter.perform(make_job("email.send", "k-email", email_payload()))

        return run

    return [
        ("429", with_fault(lambda: fake.fail_next(1, 429))),
        ("500", with_fault(lambda: fake.fail_next(1, 500))),
        ("422", with_fault(lambda: fake.fail_next(1, 422))),
        ("timeout", with_fault(fake.succeed_then_timeout)),
        ("drop", with_fault(fake.drop_connection)),
        ("wrong key", with_fault(lambda: None, key=RESEND_KEY + "x")),
    ]


def stripe_scenarios(fake: FakeStripe) -> list[tuple[str, Scenario]]:
    def with_fault(arm: Callable[[], None], key: str, **changes: object) -> Scenario:
        def run() -> None:
            arm()
            with ChargeCard(STRIPE_KEY, base_url=fake.url, timeout=SHORT_TIMEOUT) as adapter:
                adapter.perform(make_job("payment.charge", key, charge_payload(**changes)))

        return run

    def nothing() -> None:
        pass

    return [
        ("decline", with_fault(nothing, "k1", payment_method="pm_card_chargeDeclined")),
        ("429", with_fault(lambda: fake.fail_next(1, 429), "k2")),
        ("500", with_fault(lambda: fake.fail_next(1, 500), "k3")),
        ("409", with_fault(lambda: fake.fail_next(1, 409), "k4")),
        ("400", with_fault(lambda: fake.fail_next(1, 400), "k5")),
        ("timeout", with_fault(fake.succeed_then_timeout, "k6")),
        ("drop", with_fault(fake.drop_connection, "k7")),
        ("reused key", with_fault(nothing, "k-pay", amount=1)),
    ]


def test_no_secret_in_email_outcomes_or_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    with FakeEmailProvider(api_key=RESEND_KEY) as fake:
        for name, scenario in email_scenarios(fake):
            caplog.clear()
            with pytest.raises(outbox.EffectOutcome) as caught:
                scenario()
            assert_no_secret(caught.value, caplog, name)
            fake.reset()


def test_no_secret_in_stripe_outcomes_or_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    with FakeStripe(api_key=STRIPE_KEY) as fake:
        # A first charge, so that "reused key" reuses it with other parameters.
        with ChargeCard(STRIPE_KEY, base_url=fake.url) as adapter:
            adapter.perform(make_job("payment.charge", "k-pay", charge_payload()))
        for name, scenario in stripe_scenarios(fake):
            caplog.clear()
            with pytest.raises(outbox.EffectOutcome) as caught:
                scenario()
            assert_no_secret(caught.value, caplog, name)
        with (
            ChargeCard(STRIPE_KEY + "x", base_url=fake.url) as adapter,
            pytest.raises(outbox.Permanent) as refused,
        ):
            adapter.perform(make_job("payment.charge", "k-other", charge_payload()))
        assert_no_secret(refused.value, caplog)


def test_no_secret_in_webhook_outcomes_or_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    job = make_job("webhook.post", "k-hook", {"event": "e", "data": {}})
    with FakeWebhookReceiver("whsec_b3RoZXI=") as receiver:
        arms: list[Callable[[], None]] = [
            lambda: None,  # the receiver refuses our signature: 401
            receiver.succeed_then_timeout,
            receiver.fail_next,
        ]
        for arm in arms:
            caplog.clear()
            arm()
            with (
                PostWebhook(receiver.url, WEBHOOK_SECRET, timeout=SHORT_TIMEOUT) as adapter,
                pytest.raises(outbox.EffectOutcome) as caught,
            ):
                adapter.perform(job)
            assert_no_secret(caught.value, caplog)


def test_adapters_do_not_show_secrets_in_repr() -> None:
    adapters: list[SendEmail | ChargeCard | PostWebhook] = [
        SendEmail(RESEND_KEY),
        ChargeCard(STRIPE_KEY),
        PostWebhook("https://hooks.example/in?token=t0ken", WEBHOOK_SECRET),
    ]
    try:
        for adapter in adapters:
            assert not any(secret in repr(adapter) for secret in SECRETS)
        assert "t0ken" not in repr(adapters[2])
    finally:
        for adapter in adapters:
            adapter.close()
