"""ChargeCard and RefundPayment: stripe-python against FakeStripe over real HTTP."""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

import outbox
from effects import ChargeCard, ChargePayload, RefundPayment
from effects.testing import FakeStripe

from ._support import STRIPE_KEY, TIMEOUT, charge_payload, make_job

KEY = "payment-order-102"


def charge_job(key: str = KEY, **changes: Any) -> outbox.Job:
    return make_job("payment.charge", key, charge_payload(**changes))


def refund_job(payment_intent: str, key: str = "refund-order-102", **extra: Any) -> outbox.Job:
    return make_job("payment.refund", key, {"payment_intent": payment_intent, **extra})


# -- charges -------------------------------------------------------------------------


def test_charges_once_and_returns_the_payment_intent(
    stripe_fake: FakeStripe, charge_card: ChargeCard
) -> None:
    result = charge_card.perform(charge_job())

    [charge] = stripe_fake.charges
    assert result == {"id": charge["id"], "status": "succeeded", "amount": 2000, "currency": "eur"}
    assert charge["customer"] == "cus_Ada"
    assert charge["metadata"] == {"order": "102", "outbox_key": KEY}
    assert stripe_fake.requests(KEY) == 1  # the job key, unchanged, is the Idempotency-Key
    assert json.loads(json.dumps(result)) == result


def test_a_retry_with_the_same_key_replays_the_first_charge(
    stripe_fake: FakeStripe, charge_card: ChargeCard
) -> None:
    first = charge_card.perform(charge_job())
    second = charge_card.perform(charge_job())

    assert second == first
    assert stripe_fake.performed(KEY) == 1
    assert stripe_fake.requests(KEY) == 2
    assert len(stripe_fake.charges) == 1


def test_uses_the_model_the_dispatcher_validated(
    stripe_fake: FakeStripe, charge_card: ChargeCard
) -> None:
    model = ChargePayload.model_validate(charge_payload(amount=1234, currency="USD"))
    result = charge_card.perform(make_job("payment.charge", KEY, {}, model=model))

    assert (result["amount"], result["currency"]) == (1234, "usd")


def test_a_declined_card_is_permanent_with_the_decline_code(
    stripe_fake: FakeStripe, charge_card: ChargeCard
) -> None:
    job = charge_job(payment_method="pm_card_chargeDeclinedInsufficientFunds")

    with pytest.raises(outbox.Permanent) as caught:
        charge_card.perform(job)

    assert "card declined" in caught.value.reason
    assert "decline_code=insufficient_funds" in caught.value.reason
    assert KEY in caught.value.reason
    assert stripe_fake.charges == []


def test_a_declined_charge_is_replayed_not_attempted_again(
    stripe_fake: FakeStripe, charge_card: ChargeCard
) -> None:
    stripe_fake.decline_card("pm_card_mine", "do_not_honor")

    for _ in range(2):
        with pytest.raises(outbox.Permanent, match="decline_code=do_not_honor"):
            charge_card.perform(charge_job(payment_method="pm_card_mine"))

    assert stripe_fake.performed(KEY) == 1
    assert stripe_fake.requests(KEY) == 2


def test_a_card_needing_authentication_is_declined_off_session(
    charge_card: ChargeCard,
) -> None:
    with pytest.raises(outbox.Permanent, match="decline_code=authentication_required"):
        charge_card.perform(charge_job(payment_method="pm_card_authenticationRequired"))


def test_an_intent_left_requiring_action_is_permanent(charge_card: ChargeCard) -> None:
    job = charge_job(payment_method="pm_card_authenticationRequired", off_session=False)

    with pytest.raises(outbox.Permanent, match=r"PaymentIntent pi_\w+ is requires_action"):
        charge_card.perform(job)


def test_a_key_reused_for_another_charge_is_permanent_and_logged_loudly(
    stripe_fake: FakeStripe, charge_card: ChargeCard, caplog: pytest.LogCaptureFixture
) -> None:
    charge_card.perform(charge_job())

    with pytest.raises(outbox.Permanent, match="idempotency key reused") as caught:
        charge_card.perform(charge_job(amount=9999))

    assert "type=idempotency_error" in caught.value.reason
    [record] = [r for r in caplog.records if r.name == "effects.payments"]
    assert record.levelno == logging.ERROR
    assert KEY in record.getMessage()
    assert stripe_fake.performed(KEY) == 1


def test_in_flight_key_is_retried(stripe_fake: FakeStripe, charge_card: ChargeCard) -> None:
    hold = stripe_fake.hold_next()
    with ThreadPoolExecutor(max_workers=1) as pool:
        first = pool.submit(charge_card.perform, charge_job())
        hold.wait_for_arrival()
        with pytest.raises(outbox.Retry, match="code=idempotency_key_in_use"):
            charge_card.perform(charge_job())
        hold.release()
        result = first.result(timeout=TIMEOUT)

    assert result["status"] == "succeeded"
    assert stripe_fake.performed(KEY) == 1


@pytest.mark.parametrize("code", ["idempotency_key_in_use", "lock_timeout"])
def test_conflicts_are_retried(stripe_fake: FakeStripe, charge_card: ChargeCard, code: str) -> None:
    stripe_fake.fail_next(1, 409, error=code)

    with pytest.raises(outbox.Retry, match=f"HTTP 409, type=invalid_request_error code={code}"):
        charge_card.perform(charge_job())


def test_rate_limit_is_throttled_after_the_providers_delay(
    stripe_fake: FakeStripe, charge_card: ChargeCard
) -> None:
    stripe_fake.fail_next(1, 429, retry_after=3)

    with pytest.raises(outbox.Throttled, match="HTTP 429") as caught:
        charge_card.perform(charge_job())

    assert caught.value.after == 3.0


def test_past_the_accounts_rate_stripe_throttles_and_nothing_is_charged() -> None:
    with FakeStripe(api_key=STRIPE_KEY, rate_limit=1.0) as limited, ChargeCard(
            api_key=STRIPE_KEY, base_url=limited.url, timeout=TIMEOUT) as adapter:
        adapter.perform(charge_job("payment-a"))
        with pytest.raises(outbox.Throttled, match="code=rate_limit"):
            adapter.perform(charge_job("payment-b"))
        assert limited.performed("payment-b") == 0
        assert limited.throttled == 1


def test_a_lock_timeout_429_is_retried_not_throttled(
    stripe_fake: FakeStripe, charge_card: ChargeCard
) -> None:
    stripe_fake.fail_next(1, 429, error="lock_timeout")

    with pytest.raises(outbox.Retry, match="lock_timeout"):
        charge_card.perform(charge_job())


@pytest.mark.parametrize("status", [500, 503])
def test_server_errors_are_unknown_and_a_retry_charges_once(
    stripe_fake: FakeStripe, charge_card: ChargeCard, status: int
) -> None:
    stripe_fake.fail_next(1, status)

    with pytest.raises(outbox.UnknownOutcome, match=f"HTTP {status}, type=api_error"):
        charge_card.perform(charge_job())
    charge_card.perform(charge_job())

    assert stripe_fake.performed(KEY) == 1


def test_a_wrong_api_key_is_permanent(stripe_fake: FakeStripe) -> None:
    with (
        ChargeCard(api_key="sk_test_wrong", base_url=stripe_fake.url) as adapter,
        pytest.raises(outbox.Permanent, match=r"API key refused \(HTTP 401\)"),
    ):
        adapter.perform(charge_job())


def test_a_rejected_request_is_permanent_with_code_and_param(
    stripe_fake: FakeStripe, charge_card: ChargeCard
) -> None:
    stripe_fake.fail_next(1, 400, error="parameter_unknown")

    with pytest.raises(outbox.Permanent, match="HTTP 400, type=invalid_request_error"):
        charge_card.perform(charge_job())


def test_a_timeout_after_sending_is_unknown_and_the_retry_is_deduplicated(
    stripe_fake: FakeStripe, impatient_charge_card: ChargeCard
) -> None:
    stripe_fake.succeed_then_timeout()

    with pytest.raises(outbox.UnknownOutcome, match="ReadTimeout after sending"):
        impatient_charge_card.perform(charge_job())
    result = impatient_charge_card.perform(charge_job())

    assert result["id"] == stripe_fake.charges[0]["id"]
    assert stripe_fake.performed(KEY) == 1


@pytest.mark.parametrize("fault", ["succeed_then_drop", "drop_connection"])
def test_a_dropped_connection_is_unknown_and_the_retry_charges_once(
    stripe_fake: FakeStripe, charge_card: ChargeCard, fault: str
) -> None:
    getattr(stripe_fake, fault)()

    with pytest.raises(outbox.UnknownOutcome):
        charge_card.perform(charge_job())
    charge_card.perform(charge_job())

    assert stripe_fake.performed(KEY) == 1
    assert len(stripe_fake.charges) == 1


def test_a_refused_connection_is_retried(refused_url: str) -> None:
    with (
        ChargeCard(api_key=STRIPE_KEY, base_url=refused_url, timeout=TIMEOUT) as adapter,
        pytest.raises(outbox.Retry, match="could not connect"),
    ):
        adapter.perform(charge_job())


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"amount": 0}, "amount"),
        ({"amount": "2000"}, "amount"),
        ({"amount": None}, "amount"),
        ({"currency": "euro"}, "currency"),
        ({"payment_method": None}, "payment_method"),
        ({"metadata": {"k" * 41: "v"}}, "metadata"),
        ({"capture_method": "manual"}, "capture_method"),
    ],
)
def test_an_invalid_charge_payload_is_permanent_and_names_the_field(
    stripe_fake: FakeStripe, charge_card: ChargeCard, changes: dict[str, Any], field: str
) -> None:
    with pytest.raises(outbox.Permanent) as caught:
        charge_card.perform(charge_job(**changes))

    assert field in caught.value.reason
    assert stripe_fake.total_requests == 0


# -- refunds -------------------------------------------------------------------------


def test_refunds_the_whole_charge_once(
    stripe_fake: FakeStripe, charge_card: ChargeCard, refund_payment: RefundPayment
) -> None:
    intent = charge_card.perform(charge_job())

    first = refund_payment.perform(refund_job(intent["id"], reason="requested_by_customer"))
    second = refund_payment.perform(refund_job(intent["id"], reason="requested_by_customer"))

    [refund] = stripe_fake.refunds
    assert first == second == {
        "id": refund["id"],
        "status": "succeeded",
        "amount": 2000,
        "currency": "eur",
        "payment_intent": intent["id"],
    }
    assert stripe_fake.performed("refund-order-102") == 1


def test_a_partial_refund_then_too_much_is_permanent(
    charge_card: ChargeCard, refund_payment: RefundPayment
) -> None:
    intent = charge_card.perform(charge_job())
    refund_payment.perform(refund_job(intent["id"], key="refund-1", amount=1500))

    with pytest.raises(outbox.Permanent, match="code=amount_too_large param=amount"):
        refund_payment.perform(refund_job(intent["id"], key="refund-2", amount=600))


def test_refunding_an_unknown_intent_is_permanent(refund_payment: RefundPayment) -> None:
    with pytest.raises(outbox.Permanent, match="code=resource_missing param=payment_intent"):
        refund_payment.perform(refund_job("pi_missing"))


def test_a_refund_timeout_is_unknown(stripe_fake: FakeStripe, charge_card: ChargeCard) -> None:
    intent = charge_card.perform(charge_job())
    stripe_fake.succeed_then_drop()

    with RefundPayment(STRIPE_KEY, base_url=stripe_fake.url, timeout=TIMEOUT) as adapter:
        with pytest.raises(outbox.UnknownOutcome):
            adapter.perform(refund_job(intent["id"]))
        adapter.perform(refund_job(intent["id"]))

    assert len(stripe_fake.refunds) == 1


@pytest.mark.parametrize(
    ("extra", "field"),
    [({"amount": -5}, "amount"), ({"reason": "changed_mind"}, "reason")],
)
def test_an_invalid_refund_payload_is_permanent_and_names_the_field(
    refund_payment: RefundPayment, extra: dict[str, Any], field: str
) -> None:
    with pytest.raises(outbox.Permanent) as caught:
        refund_payment.perform(refund_job("pi_1", **extra))

    assert field in caught.value.reason


def test_refuses_an_empty_api_key() -> None:
    with pytest.raises(ValueError, match="API key"):
        ChargeCard(api_key="")


def test_one_adapter_serves_many_threads(stripe_fake: FakeStripe, charge_card: ChargeCard) -> None:
    keys = [f"payment-{n}" for n in range(24)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda key: charge_card.perform(charge_job(key)), keys))

    assert all(stripe_fake.performed(key) == 1 for key in keys)
    assert len({result["id"] for result in results}) == len(stripe_fake.charges) == len(keys)
