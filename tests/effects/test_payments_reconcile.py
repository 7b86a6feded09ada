"""``ChargeCard.reconcile`` against the fake Stripe's list and search, and the fake's
list, search and lost-response switch through the official ``stripe`` library."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import stripe

import outbox
from effects import ChargeCard, payments
from effects.testing import FakeStripe

from ._support import STRIPE_KEY, charge_payload, make_job


def _job(key: str, **changes: object) -> outbox.Job:
    job = make_job("payment.charge", key, charge_payload(**changes))
    return dataclasses.replace(job, first_attempted_at=datetime.now(UTC) - timedelta(seconds=5))


def _client(fake: FakeStripe) -> stripe.StripeClient:
    return stripe.StripeClient(STRIPE_KEY, base_addresses={"api": fake.url},
                               max_network_retries=0)


def test_a_lost_response_is_found_by_its_key_and_reported_performed(
    stripe_fake: FakeStripe, charge_card: ChargeCard,
) -> None:
    stripe_fake.lose_responses(1.0)
    with pytest.raises(outbox.UnknownOutcome):
        charge_card.perform(_job("order-1"))
    assert stripe_fake.lost_responses == ["order-1"]
    stripe_fake.lose_responses(0.0)
    charge_card.perform(_job("order-2"))  # another intent of the same customer

    answer = charge_card.reconcile(_job("order-1"))
    [intent] = [i for i in stripe_fake.payment_intents
                if i["metadata"].get("outbox_key") == "order-1"]
    assert answer == outbox.Performed({"id": intent["id"], "status": "succeeded",
                                       "amount": 2000, "currency": "eur"})
    assert stripe_fake.performed("order-1") == 1


def test_no_intent_with_the_key_is_not_performed(
    stripe_fake: FakeStripe, charge_card: ChargeCard,
) -> None:
    charge_card.perform(_job("order-2"))
    assert charge_card.reconcile(_job("order-3")) == outbox.NotPerformed()
    # Another customer's intent with the key would not be looked at either.
    assert charge_card.reconcile(_job("order-2", customer="cus_Bob")) == outbox.NotPerformed()


def test_a_declined_intent_found_is_permanent(
    stripe_fake: FakeStripe, charge_card: ChargeCard,
) -> None:
    stripe_fake.lose_responses(1.0)
    with pytest.raises(outbox.UnknownOutcome):
        charge_card.perform(_job("order-4", payment_method="pm_card_visa_chargeDeclined"))
    # A declined charge's answer is a 402 that was lost too; its intent is listed.
    with pytest.raises(outbox.Permanent, match="card declined .*code=card_declined"):
        charge_card.reconcile(_job("order-4", payment_method="pm_card_visa_chargeDeclined"))


def test_past_the_listed_pages_search_decides_and_its_lag_is_respected(
    stripe_fake: FakeStripe, charge_card: ChargeCard, monkeypatch: pytest.MonkeyPatch,
) -> None:
    for n in range(3):
        charge_card.perform(_job(f"order-{n}"))
    monkeypatch.setattr(payments, "LIST_PAGES", 0)  # as if the customer had thousands
    stripe_fake.set_search_lag(3600)
    assert charge_card.reconcile(_job("order-1")) is None  # search cannot see it yet
    assert charge_card.reconcile(_job("order-9")) is None  # nor prove it absent
    stripe_fake.set_search_lag(0)
    found = charge_card.reconcile(_job("order-1"))
    assert isinstance(found, outbox.Performed) and found.result is not None
    old = dataclasses.replace(_job("order-9"),
                              first_attempted_at=datetime.now(UTC) - timedelta(hours=2))
    assert charge_card.reconcile(old) == outbox.NotPerformed()


def test_an_unreachable_stripe_raises_for_the_reconciler_to_count_as_such(
    refused_url: str,
) -> None:
    with ChargeCard(STRIPE_KEY, base_url=refused_url, timeout=1.0) as adapter, \
            pytest.raises(stripe.APIConnectionError):
        adapter.reconcile(_job("order-1"))


def test_fake_lists_newest_first_with_filters_and_pagination(stripe_fake: FakeStripe) -> None:
    client = _client(stripe_fake)
    ids = []
    for n in range(5):
        intent = client.v1.payment_intents.create(
            params={"amount": 100 + n, "currency": "eur", "customer": "cus_A" if n % 2 else "cus_B",
                    "metadata": {"n": str(n)}})
        ids.append(intent.id)
    first = client.v1.payment_intents.list(params={"limit": 2})
    assert [i.id for i in first.data] == ids[::-1][:2] and first.has_more
    rest = client.v1.payment_intents.list(params={"limit": 10, "starting_after": first.data[-1].id})
    assert [i.id for i in rest.data] == ids[::-1][2:] and not rest.has_more
    by_customer = client.v1.payment_intents.list(params={"customer": "cus_A"})
    assert [i.id for i in by_customer.data] == [ids[3], ids[1]]
    now = int(stripe_fake.now())
    assert client.v1.payment_intents.list(params={"created": {"gt": now + 10}}).data == []
    assert len(client.v1.payment_intents.list(params={"created": {"gte": now - 10}}).data) == 5
    every = list(client.v1.payment_intents.list(params={"limit": 2}).auto_paging_iter())
    assert [i.id for i in every] == ids[::-1]
    found = client.v1.payment_intents.search(params={"query": "metadata['n']:'3'"})
    assert [i.id for i in found.data] == [ids[3]]
    found = client.v1.payment_intents.search(
        params={"query": 'customer:"cus_B" AND metadata["n"]:"4"'})
    assert [i.id for i in found.data] == [ids[4]]
    with pytest.raises(stripe.InvalidRequestError):
        client.v1.payment_intents.list(params={"limit": 101})
    with pytest.raises(stripe.InvalidRequestError):
        client.v1.payment_intents.search(params={"query": "nonsense"})


def test_fake_lost_response_keeps_the_answer_for_the_key(stripe_fake: FakeStripe) -> None:
    client = _client(stripe_fake)
    stripe_fake.lose_responses(1.0)
    params: Any = {"amount": 100, "currency": "eur"}
    with pytest.raises(stripe.APIConnectionError):
        client.v1.payment_intents.create(params=params, options={"idempotency_key": "k1"})
    stripe_fake.lose_responses(0.0)
    replay = client.v1.payment_intents.create(params=params, options={"idempotency_key": "k1"})
    assert [i["id"] for i in stripe_fake.payment_intents] == [replay.id]
    assert stripe_fake.performed("k1") == 1
    with pytest.raises(ValueError, match="between 0 and 1"):
        stripe_fake.lose_responses(1.5)
