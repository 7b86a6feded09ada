"""The fakes' per-tenant limits: FakeStripe per account, FakeEmailProvider per sending
domain, over real HTTP (stripe-python for Stripe).

The rates are low (0.5/s: a bucket of one token, the next after 2 s) so that a burst of
a few requests finds the bucket empty even on a loaded machine; assertions are about
who was refused at all, and the counters are checked against the answers seen, never
against a number of requests admitted in a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import stripe

from effects.testing import FakeEmailProvider, FakeStripe

from ._support import RESEND_KEY, STRIPE_KEY, TIMEOUT, email_payload

SLOW = 0.5  # requests per second: one token, refilled after 2 s
EMAIL_HEADERS = {"Authorization": f"Bearer {RESEND_KEY}"}
PLATFORM = FakeStripe.PLATFORM_ACCOUNT


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=TIMEOUT) as client:
        yield client


@pytest.fixture
def stripe_client() -> Iterator[tuple[FakeStripe, stripe.StripeClient]]:
    """A fake limiting each account to SLOW, and stripe-python's own client for it."""
    transport = stripe.RequestsClient()
    with FakeStripe(api_key=STRIPE_KEY, rate_limit_per_account=SLOW) as fake:
        client = stripe.StripeClient(STRIPE_KEY, base_addresses={"api": fake.url},
                                     max_network_retries=0, http_client=transport)
        try:
            yield fake, client
        finally:
            transport.close()  # type: ignore[no-untyped-call]  # unannotated in stripe


def create_intent(client: stripe.StripeClient, account: str | None) -> int:
    """Create a PaymentIntent acting on ``account`` (None: the platform); the status."""
    options: Any = {} if account is None else {"stripe_account": account}
    try:
        client.v1.payment_intents.create(params={"amount": 500, "currency": "eur"},
                                         options=options)
    except stripe.RateLimitError as refused:
        assert refused.http_status == 429
        body: Any = refused.json_body  # stripe-python sets no code on this error
        assert body["error"]["code"] == "rate_limit"
        return 429
    return 200


def send_email(http: httpx.Client, fake: FakeEmailProvider, sender: str) -> httpx.Response:
    return http.post(f"{fake.url}/emails", json=email_payload(**{"from": sender}),
                     headers=EMAIL_HEADERS)


def send_batch(http: httpx.Client, fake: FakeEmailProvider, *senders: str) -> httpx.Response:
    batch = [email_payload(**{"from": sender}) for sender in senders]
    return http.post(f"{fake.url}/emails/batch", json=batch, headers=EMAIL_HEADERS)


# -- Stripe: per account -----------------------------------------------------------------


def test_an_account_past_its_rate_is_refused_while_another_is_admitted(
    stripe_client: tuple[FakeStripe, stripe.StripeClient],
) -> None:
    fake, client = stripe_client
    a_first = [create_intent(client, "acct_A") for _ in range(5)]
    b_meanwhile = create_intent(client, "acct_B")
    a_after = create_intent(client, "acct_A")
    a = [*a_first, a_after]

    assert a_first[0] == 200
    assert a.count(429) >= 1
    assert b_meanwhile == 200
    assert fake.requests_by_account() == {"acct_A": 6, "acct_B": 1}
    assert fake.throttled_by_account() == {"acct_A": a.count(429)}
    assert fake.throttled == a.count(429)
    assert len(fake.payment_intents) == a.count(200) + 1


def test_the_platform_account_has_a_bucket_of_its_own(
    stripe_client: tuple[FakeStripe, stripe.StripeClient],
) -> None:
    fake, client = stripe_client
    platform = [create_intent(client, None) for _ in range(4)]
    connected = create_intent(client, "acct_A")

    assert platform[0] == 200
    assert platform.count(429) >= 1
    assert connected == 200
    assert fake.requests_by_account() == {PLATFORM: 4, "acct_A": 1}
    assert fake.throttled_by_account() == {PLATFORM: platform.count(429)}


def test_an_empty_stripe_account_header_is_the_platform(http: httpx.Client) -> None:
    with FakeStripe(api_key=STRIPE_KEY, rate_limit_per_account=SLOW) as fake:
        headers = {"Authorization": f"Bearer {STRIPE_KEY}"}
        form = {"amount": "500", "currency": "eur"}
        url = f"{fake.url}/v1/payment_intents"
        statuses = [http.post(url, data=form, headers=headers).status_code,
                    *(http.post(url, data=form, headers={**headers, "Stripe-Account": ""})
                      .status_code for _ in range(3))]

        assert statuses[0] == 200
        assert statuses.count(429) >= 1
        assert fake.requests_by_account() == {PLATFORM: 4}


def test_the_per_account_429_is_stripes_rate_limit(http: httpx.Client) -> None:
    with FakeStripe(api_key=STRIPE_KEY, rate_limit_per_account=SLOW) as fake:
        headers = {"Authorization": f"Bearer {STRIPE_KEY}", "Stripe-Account": "acct_A"}
        form = {"amount": "500", "currency": "eur"}
        answers = [http.post(f"{fake.url}/v1/payment_intents", data=form, headers=headers)
                   for _ in range(4)]
        refused = next(a for a in answers if a.status_code == 429)

        assert refused.json()["error"]["code"] == "rate_limit"
        assert refused.json()["error"]["type"] == "invalid_request_error"
        assert refused.headers["Stripe-Should-Retry"] == "true"
        assert "Retry-After" not in refused.headers


def test_both_limits_apply_and_a_refusal_spends_neither(
    stripe_client: tuple[FakeStripe, stripe.StripeClient],
) -> None:
    fake, client = stripe_client
    fake.set_rate_limit(SLOW)  # the server's bucket: one token, as acct_A's and acct_B's

    assert create_intent(client, "acct_A") == 200  # the server's token and acct_A's
    b_refused_by_server = [create_intent(client, "acct_B") for _ in range(3)]
    fake.set_rate_limit(None)
    a_refused_by_account = [create_intent(client, "acct_A") for _ in range(3)]
    b_after = create_intent(client, "acct_B")

    assert b_refused_by_server.count(429) >= 1
    assert a_refused_by_account.count(429) >= 1
    # acct_B's token was not spent by the requests the server refused
    assert b_after == 200 or b_refused_by_server.count(200) >= 1
    throttled = b_refused_by_server.count(429) + a_refused_by_account.count(429)
    assert fake.throttled == throttled
    assert sum(fake.throttled_by_account().values()) == throttled
    assert fake.requests_by_account() == {"acct_A": 4, "acct_B": 4}
    assert sum(fake.requests_by_account().values()) == fake.total_requests


def test_a_per_account_limit_can_be_changed_and_lifted(
    stripe_client: tuple[FakeStripe, stripe.StripeClient],
) -> None:
    fake, client = stripe_client
    assert [create_intent(client, "acct_A") for _ in range(4)].count(429) >= 1

    fake.set_rate_limit_per_account(None)
    assert [create_intent(client, "acct_A") for _ in range(4)] == [200] * 4
    fake.set_rate_limit_per_account(SLOW)  # every account's bucket full again
    assert create_intent(client, "acct_A") == 200

    fake.reset()
    assert fake.requests_by_account() == {} and fake.throttled_by_account() == {}


def test_a_per_account_rate_must_be_positive() -> None:
    with FakeStripe() as fake:
        for rate in (0, -1.0, "2"):
            with pytest.raises(ValueError, match="rate_limit_per_account must be a positive"):
                fake.set_rate_limit_per_account(rate)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rate_limit_per_account"):
        FakeStripe(rate_limit_per_account=0)


def test_without_a_per_account_limit_accounts_are_still_counted(http: httpx.Client) -> None:
    with FakeStripe(api_key=STRIPE_KEY) as fake:
        headers = {"Authorization": f"Bearer {STRIPE_KEY}"}
        for account in ("acct_A", "acct_A", None):
            extra = {} if account is None else {"Stripe-Account": account}
            answer = http.get(f"{fake.url}/v1/payment_intents", headers={**headers, **extra})
            assert answer.status_code == 200

        assert fake.requests_by_account() == {"acct_A": 2, PLATFORM: 1}
        assert fake.throttled_by_account() == {}


# -- email: per sending domain -----------------------------------------------------------


def test_two_sending_domains_are_limited_separately(http: httpx.Client) -> None:
    with FakeEmailProvider(api_key=RESEND_KEY, rate_limit_per_domain=SLOW) as fake:
        shop = [send_email(http, fake, "shop@shop.example").status_code for _ in range(5)]
        news = send_email(http, fake, "news@news.example").status_code

        assert shop[0] == 200
        assert shop.count(429) >= 1
        assert news == 200
        assert fake.requests_by_domain() == {"shop.example": 5, "news.example": 1}
        assert fake.throttled_by_domain() == {"shop.example": shop.count(429)}
        assert fake.throttled == shop.count(429)
        assert len(fake.sent_emails) == shop.count(200) + 1


def test_the_name_and_address_form_is_read_for_its_lower_cased_domain(
    http: httpx.Client,
) -> None:
    with FakeEmailProvider(api_key=RESEND_KEY, rate_limit_per_domain=SLOW) as fake:
        senders = ["Shop <shop@Example.com>", "orders@EXAMPLE.COM",
                   '"Shop, Inc." <a@example.com>']
        answers = [send_email(http, fake, sender) for sender in senders]

        assert answers[0].status_code == 200
        assert [a.status_code for a in answers].count(429) >= 1  # one bucket for all three
        assert fake.requests_by_domain() == {"example.com": 3}
        refused = next(a for a in answers if a.status_code == 429)
        assert refused.json()["name"] == "rate_limit_exceeded"
        assert refused.headers["ratelimit-limit"] == "0.5"
        assert int(refused.headers["retry-after"]) >= 1


def test_a_batch_takes_one_token_from_each_of_its_domains(http: httpx.Client) -> None:
    with FakeEmailProvider(api_key=RESEND_KEY, rate_limit_per_domain=SLOW) as fake:
        one_domain = send_batch(http, fake, "a@one.example", "b@one.example", "c@one.example")
        assert one_domain.status_code == 200  # one request: one token, not three
        assert len(fake.sent_emails) == 3

        spent = [send_email(http, fake, "a@one.example").status_code for _ in range(3)]
        assert spent.count(429) >= 1
        sent_before = len(fake.sent_emails)
        mixed = [send_batch(http, fake, "x@two.example", "a@one.example").status_code
                 for _ in range(3)]
        assert mixed.count(429) >= 1
        # a refused batch sends nothing and takes no token from two.example
        assert len(fake.sent_emails) == sent_before + 2 * mixed.count(200)
        if mixed.count(200) == 0:
            assert send_email(http, fake, "x@two.example").status_code == 200

        by_domain = fake.requests_by_domain()
        assert by_domain["one.example"] == 1 + 3 + 3
        assert by_domain["two.example"] in (3, 4)
        throttled = fake.throttled_by_domain()
        assert throttled["one.example"] == spent.count(429) + mixed.count(429)
        assert throttled.get("two.example", 0) == mixed.count(429)


def test_requests_with_no_sending_domain_are_not_limited_per_domain(
    http: httpx.Client,
) -> None:
    with FakeEmailProvider(api_key=RESEND_KEY, rate_limit_per_domain=SLOW) as fake:
        listed = [http.get(f"{fake.url}/emails", headers=EMAIL_HEADERS).status_code
                  for _ in range(3)]
        no_domain = [send_email(http, fake, "nobody").status_code for _ in range(3)]
        not_json = http.post(f"{fake.url}/emails", content=b"{", headers=EMAIL_HEADERS)

        assert listed == [200] * 3
        assert no_domain == [200] * 3  # the fake sends it; no domain bucket to empty
        assert not_json.status_code == 400
        assert fake.requests_by_domain() == {}
        assert fake.throttled == 0


def test_a_per_domain_limit_can_be_lifted(http: httpx.Client) -> None:
    with FakeEmailProvider(api_key=RESEND_KEY) as fake:
        fake.set_rate_limit_per_domain(SLOW)
        assert [send_email(http, fake, "a@x.example").status_code
                for _ in range(4)].count(429) >= 1

        fake.set_rate_limit_per_domain(None)
        assert [send_email(http, fake, "a@x.example").status_code
                for _ in range(4)] == [200] * 4
        with pytest.raises(ValueError, match="rate_limit_per_domain must be a positive"):
            fake.set_rate_limit_per_domain(0)
