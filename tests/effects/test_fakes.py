"""The fake providers themselves, over raw HTTP: idempotency, faults, counters, lifecycle."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import stripe

from effects import compute_signature
from effects._signing import WebhookSecret
from effects.testing import FakeEmailProvider, FakeStripe, FakeWebhookReceiver

from ._support import RESEND_KEY, STRIPE_KEY, TIMEOUT, email_payload

EMAIL_HEADERS = {"Authorization": f"Bearer {RESEND_KEY}"}
STRIPE_HEADERS = {"Authorization": f"Bearer {STRIPE_KEY}"}


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=TIMEOUT) as client:
        yield client


def post_email(
    http: httpx.Client, fake: FakeEmailProvider, key: str | None, **changes: Any
) -> httpx.Response:
    headers = dict(EMAIL_HEADERS)
    if key is not None:
        headers["Idempotency-Key"] = key
    return http.post(f"{fake.url}/emails", json=email_payload(**changes), headers=headers)


def post_intent(
    http: httpx.Client, fake: FakeStripe, key: str, **params: str
) -> httpx.Response:
    form = {"amount": "500", "currency": "eur", "confirm": "true", "payment_method": "pm_x"}
    headers = {**STRIPE_HEADERS, "Idempotency-Key": key}
    return http.post(f"{fake.url}/v1/payment_intents", data={**form, **params}, headers=headers)


# -- email: idempotency --------------------------------------------------------------


def test_email_same_key_same_body_is_replayed(
    resend: FakeEmailProvider, http: httpx.Client
) -> None:
    first = post_email(http, resend, "k1")
    second = post_email(http, resend, "k1")

    assert first.status_code == second.status_code == 200
    assert first.json() == second.json()
    assert (resend.performed("k1"), resend.requests("k1")) == (1, 2)
    assert len(resend.sent_emails) == 1


def test_email_same_key_other_body_is_refused(
    resend: FakeEmailProvider, http: httpx.Client
) -> None:
    post_email(http, resend, "k1")
    response = post_email(http, resend, "k1", subject="Other")

    assert response.status_code == 409
    assert response.json()["name"] == "invalid_idempotent_request"
    assert response.json()["statusCode"] == 409


def test_email_without_a_key_is_sent_every_time(
    resend: FakeEmailProvider, http: httpx.Client
) -> None:
    post_email(http, resend, None)
    post_email(http, resend, None)

    assert resend.total_performed == 2
    assert resend.performed_keys() == []


def test_email_key_is_forgotten_after_the_retention_window(
    resend: FakeEmailProvider, http: httpx.Client
) -> None:
    post_email(http, resend, "k1")
    resend.advance(resend.retention - 1)
    post_email(http, resend, "k1")
    assert resend.performed("k1") == 1

    resend.advance(1)
    post_email(http, resend, "k1")

    # Past the window a resend acts again: why an unknown outcome must go to reconcile.
    assert resend.performed("k1") == 2


def test_concurrent_requests_with_one_key_perform_once(
    resend: FakeEmailProvider, http: httpx.Client
) -> None:
    with ThreadPoolExecutor(max_workers=8) as pool:
        responses = list(pool.map(lambda _: post_email(http, resend, "k1"), range(16)))

    assert resend.performed("k1") == 1
    ids = {r.json()["id"] for r in responses if r.status_code == 200}
    assert ids == {resend.sent_emails[0].id}
    refused = {r.json()["name"] for r in responses if r.status_code != 200}
    assert refused <= {"concurrent_idempotent_requests"}


# -- email: validation and refusals ---------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "status", "name"),
    [
        ({}, 401, "missing_api_key"),
        ({"Authorization": "Bearer re_other"}, 403, "invalid_api_key"),
        ({**EMAIL_HEADERS, "Idempotency-Key": "k" * 257}, 400, "invalid_idempotency_key"),
    ],
)
def test_email_refusals(
    resend: FakeEmailProvider,
    http: httpx.Client,
    headers: dict[str, str],
    status: int,
    name: str,
) -> None:
    response = http.post(f"{resend.url}/emails", json=email_payload(), headers=headers)

    assert (response.status_code, response.json()["name"]) == (status, name)
    assert resend.total_performed == 0


@pytest.mark.parametrize(
    ("changes", "name", "field"),
    [
        ({"to": None}, "missing_required_field", "`to`"),
        ({"subject": None}, "missing_required_field", "`subject`"),
        ({"to": []}, "validation_error", "`to`"),
        ({"text": None}, "validation_error", "`text` or `html`"),
    ],
)
def test_email_validation(
    resend: FakeEmailProvider, http: httpx.Client, changes: dict[str, Any], name: str, field: str
) -> None:
    response = post_email(http, resend, "k1", **changes)

    assert response.status_code == 422
    assert response.json()["name"] == name
    assert field in response.json()["message"]
    # A refused request does not take the key: the corrected one goes through.
    assert post_email(http, resend, "k1").status_code == 200


def test_email_unknown_path_and_method(resend: FakeEmailProvider, http: httpx.Client) -> None:
    assert http.post(f"{resend.url}/nope", headers=EMAIL_HEADERS).status_code == 404
    assert http.delete(f"{resend.url}/emails", headers=EMAIL_HEADERS).status_code == 405


# -- faults --------------------------------------------------------------------------


def test_fail_next_answers_exactly_n_requests(
    resend: FakeEmailProvider, http: httpx.Client
) -> None:
    resend.fail_next(2, 503, retry_after=4)

    statuses = [post_email(http, resend, "k1").status_code for _ in range(3)]
    assert statuses == [503, 503, 200]
    assert resend.requests("k1") == 3
    assert resend.performed("k1") == 1


def test_fail_next_uses_the_providers_error_shape(
    resend: FakeEmailProvider, stripe_fake: FakeStripe, http: httpx.Client
) -> None:
    resend.fail_next(1, 429, retry_after=4)
    stripe_fake.fail_next(1, 500)

    email = post_email(http, resend, "k1")
    intent = post_intent(http, stripe_fake, "k1")

    assert email.headers["Retry-After"] == "4"
    assert email.json() == {
        "statusCode": 429, "name": "rate_limit_exceeded", "message": "injected failure"
    }
    assert intent.json()["error"]["type"] == "api_error"


def test_latency_delays_every_request(resend: FakeEmailProvider, http: httpx.Client) -> None:
    resend.set_latency(0.2)

    started = time.monotonic()
    post_email(http, resend, "k1")

    assert time.monotonic() - started >= 0.2


def test_a_stalled_answer_is_sent_once_released(
    resend: FakeEmailProvider, http: httpx.Client
) -> None:
    resend.succeed_then_timeout()
    with ThreadPoolExecutor(max_workers=1) as pool:
        answer = pool.submit(post_email, http, resend, "k1")
        resend.wait_for_stalls(1)
        # Performed and saved while the answer is still held back.
        replay = post_email(http, resend, "k1")
        assert not answer.done()
        resend.release_stalled()
        assert answer.result(timeout=TIMEOUT).json() == replay.json()

    assert resend.performed("k1") == 1


def test_dropped_connections_leave_the_client_without_an_answer(
    resend: FakeEmailProvider, http: httpx.Client
) -> None:
    resend.drop_connection()
    with pytest.raises(httpx.RemoteProtocolError):
        post_email(http, resend, "k1")
    assert resend.performed("k1") == 0

    resend.succeed_then_drop()
    with pytest.raises(httpx.RemoteProtocolError):
        post_email(http, resend, "k2")
    assert resend.performed("k2") == 1


def test_fault_counts_must_be_positive(resend: FakeEmailProvider) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        resend.fail_next(0)


def test_reset_forgets_keys_counts_records_and_faults(
    resend: FakeEmailProvider, http: httpx.Client
) -> None:
    post_email(http, resend, "k1")
    resend.fail_next(5, 500)
    resend.advance(10)

    resend.reset()

    assert (resend.performed("k1"), resend.requests("k1"), resend.total_requests) == (0, 0, 0)
    assert resend.sent_emails == []
    assert post_email(http, resend, "k1").status_code == 200
    assert resend.performed("k1") == 1


# -- lifecycle -----------------------------------------------------------------------


def test_close_releases_held_requests_and_joins_threads(http: httpx.Client) -> None:
    fake = FakeEmailProvider()
    hold = fake.hold_next()
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(post_email, http, fake, "k1")
        hold.wait_for_arrival()
        fake.close()
        fake.close()  # idempotent
        # Answered or cut off by the close, but never left hanging.
        with contextlib.suppress(httpx.TransportError):
            pending.result(timeout=TIMEOUT)

    with pytest.raises(httpx.ConnectError):
        post_email(http, fake, "k2")


def test_close_does_not_wait_for_silent_clients(http: httpx.Client) -> None:
    fake = FakeWebhookReceiver("whsec_cw==")
    host, port = fake.url.split("//")[1].split("/")[0].split(":")
    with socket.create_connection((host, int(port))):
        # Connections are accepted in order: once this one is answered, the silent one
        # above has a handler thread blocked reading from it.
        assert http.get(fake.url).status_code == 405
        started = time.monotonic()
        fake.close()
        # Well below the 10 s a handler would otherwise wait for the silent client.
        assert time.monotonic() - started < 5


# -- stripe --------------------------------------------------------------------------


def test_stripe_replays_saved_answers_marked_as_replays(
    stripe_fake: FakeStripe, http: httpx.Client
) -> None:
    first = post_intent(http, stripe_fake, "k1")
    second = post_intent(http, stripe_fake, "k1")

    assert first.json() == second.json()
    assert "Idempotent-Replayed" not in first.headers
    assert second.headers["Idempotent-Replayed"] == "true"


def test_stripe_saves_and_replays_errors_that_executed(
    stripe_fake: FakeStripe, http: httpx.Client
) -> None:
    first = post_intent(http, stripe_fake, "k1", payment_method="pm_card_chargeDeclined")
    second = post_intent(http, stripe_fake, "k1", payment_method="pm_card_chargeDeclined")

    assert first.status_code == second.status_code == 402
    assert second.json() == first.json()
    assert first.json()["error"]["decline_code"] == "generic_decline"
    assert stripe_fake.performed("k1") == 1
    assert stripe_fake.charges == []
    assert [i["status"] for i in stripe_fake.payment_intents] == ["requires_payment_method"]


def test_stripe_takes_keys_of_1_to_255_characters(
    stripe_fake: FakeStripe, http: httpx.Client
) -> None:
    # Stripe's limit: the longest key our key rule allows (255) is taken, one more refused
    # before anything is performed.
    longest = post_intent(http, stripe_fake, "k" * 255)
    refused = post_intent(http, stripe_fake, "k" * 256)

    assert longest.status_code == 200
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "idempotency_key_invalid"
    assert stripe_fake.performed("k" * 255) == 1 and stripe_fake.performed("k" * 256) == 0


def test_stripe_does_not_save_requests_refused_by_checks(
    stripe_fake: FakeStripe, http: httpx.Client
) -> None:
    refused = post_intent(http, stripe_fake, "k1", amount="0")
    accepted = post_intent(http, stripe_fake, "k1")

    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "amount"
    assert accepted.status_code == 200


@pytest.mark.parametrize("path", ["/v1/payment_intents", "/v1/refunds"])
def test_stripe_key_reused_with_other_params_or_endpoint(
    stripe_fake: FakeStripe, http: httpx.Client, path: str
) -> None:
    post_intent(http, stripe_fake, "k1")
    headers = {**STRIPE_HEADERS, "Idempotency-Key": "k1"}
    params = {"amount": "1", "currency": "eur", "payment_intent": "pi_1"}
    response = http.post(f"{stripe_fake.url}{path}", data=params, headers=headers)

    assert response.status_code == 400
    assert response.json()["error"]["type"] == "idempotency_error"


def test_stripe_in_flight_key(stripe_fake: FakeStripe, http: httpx.Client) -> None:
    hold = stripe_fake.hold_next()
    with ThreadPoolExecutor(max_workers=1) as pool:
        first = pool.submit(post_intent, http, stripe_fake, "k1")
        hold.wait_for_arrival()
        second = post_intent(http, stripe_fake, "k1")
        hold.release()
        assert first.result(timeout=TIMEOUT).status_code == 200

    assert second.status_code == 409
    assert second.json()["error"]["code"] == "idempotency_key_in_use"


def test_stripe_python_creates_and_retrieves_through_the_fake(stripe_fake: FakeStripe) -> None:
    # stripe-python's own default HTTP client (requests), not the adapters' transport.
    transport = stripe.RequestsClient()
    client = stripe.StripeClient(
        STRIPE_KEY,
        base_addresses={"api": stripe_fake.url},
        max_network_retries=0,
        http_client=transport,
    )
    try:
        created = client.v1.payment_intents.create(
            params={"amount": 700, "currency": "usd", "metadata": {"order": "9"}},
            options={"idempotency_key": "k1"},
        )
        fetched = client.v1.payment_intents.retrieve(created.id)
    finally:
        transport.close()  # type: ignore[no-untyped-call]  # unannotated in stripe

    assert fetched.id == created.id
    assert fetched.status == "requires_payment_method"
    assert fetched.metadata["order"] == "9"


def test_stripe_refusals(stripe_fake: FakeStripe, http: httpx.Client) -> None:
    missing = http.post(f"{stripe_fake.url}/v1/payment_intents", data={"amount": "1"})
    wrong = http.post(
        f"{stripe_fake.url}/v1/payment_intents", headers={"Authorization": "Bearer sk_other"}
    )
    unknown = http.get(f"{stripe_fake.url}/v1/charges/ch_1", headers=STRIPE_HEADERS)

    assert (missing.status_code, wrong.status_code, unknown.status_code) == (401, 401, 404)
    assert "sk_other" not in wrong.text


# -- webhook receiver ----------------------------------------------------------------


RIGHT, WRONG, S = "whsec_cmlnaHQ=", "whsec_d3Jvbmc=", "whsec_cw=="


def signed(
    secret: WebhookSecret | Sequence[WebhookSecret],
    body: bytes,
    key: str,
    timestamp: int | None = None,
) -> dict[str, str]:
    stamp = int(time.time()) if timestamp is None else timestamp
    return {
        "webhook-id": key,
        "webhook-timestamp": str(stamp),
        "webhook-signature": compute_signature(secret, key, stamp, body),
    }


@pytest.mark.parametrize(
    ("secret", "age", "status"),
    [(RIGHT, 0, 200), (WRONG, 0, 401), (RIGHT, 301, 401)],
)
def test_webhook_receiver_checks_signatures(
    http: httpx.Client, secret: str, age: int, status: int
) -> None:
    body = b'{"data":null,"event":"e","id":"k1"}'
    with FakeWebhookReceiver(RIGHT) as receiver:
        headers = signed(secret, body, "k1", int(time.time()) - age)
        response = http.post(receiver.url, content=body, headers=headers)

        assert response.status_code == status
        assert receiver.performed("k1") == (1 if status == 200 else 0)


def test_webhook_receiver_requires_a_key_matching_the_body(http: httpx.Client) -> None:
    body = b'{"data":null,"event":"e","id":"k1"}'
    with FakeWebhookReceiver(S) as receiver:
        no_key = http.post(receiver.url, content=body, headers=signed(S, body, ""))
        other_key = http.post(receiver.url, content=body, headers=signed(S, body, "k2"))

    # Without an id there is nothing to verify (401); a body for another id is refused.
    assert (no_key.status_code, other_key.status_code) == (401, 400)


def test_webhook_receiver_accepts_old_and_new_secrets_while_rotating(
    http: httpx.Client,
) -> None:
    body = b'{"data":null,"event":"e","id":"k1"}'
    with FakeWebhookReceiver([RIGHT, S]) as receiver:
        old = http.post(receiver.url, content=body, headers=signed(S, body, "k1"))
        wrong = http.post(receiver.url, content=body, headers=signed(WRONG, body, "k1"))

    assert (old.status_code, wrong.status_code) == (200, 401)


def test_webhook_receiver_refuses_a_malformed_secret() -> None:
    with pytest.raises(ValueError, match="whsec_") as caught:
        FakeWebhookReceiver("whsec_not base64!")

    assert "not base64!" not in str(caught.value)


# -- the pytest plugin ---------------------------------------------------------------


def test_plugin_fixtures_yield_started_fakes(
    fake_email: FakeEmailProvider,
    fake_stripe: FakeStripe,
    fake_webhook: FakeWebhookReceiver,
    http: httpx.Client,
) -> None:
    assert post_email(http, fake_email, "k1").status_code == 200
    assert post_intent(http, fake_stripe, "k1").status_code == 200
    body = b'{"data":1,"event":"e","id":"k1"}'
    headers = signed(fake_webhook.secret, body, "k1")
    assert http.post(fake_webhook.url, content=body, headers=headers).status_code == 200
    assert fake_email.performed("k1") == fake_stripe.performed("k1") == 1
    assert fake_webhook.performed("k1") == 1


# -- pushing back: rate limits and outages ---------------------------------------------


def test_email_past_its_rate_limit_answers_as_resend(http: httpx.Client) -> None:
    with FakeEmailProvider(api_key=RESEND_KEY, rate_limit=2.0) as limited:
        answers = [post_email(http, limited, f"k{i}") for i in range(3)]

        assert [a.status_code for a in answers] == [200, 200, 429]
        refused = answers[2]
        assert refused.json()["name"] == "rate_limit_exceeded"
        assert refused.headers["ratelimit-limit"] == "2"
        assert refused.headers["ratelimit-remaining"] == "0"
        assert int(refused.headers["ratelimit-reset"]) >= 1
        assert int(refused.headers["retry-after"]) >= 1
        assert limited.performed("k2") == 0
        assert limited.throttled == 1
        assert limited.total_requests == 3


def test_stripe_past_its_rate_limit_answers_rate_limit(http: httpx.Client) -> None:
    with FakeStripe(api_key=STRIPE_KEY, rate_limit=1.0) as limited:
        first = post_intent(http, limited, "k1")
        refused = post_intent(http, limited, "k2")

        assert first.status_code == 200
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "rate_limit"
        assert refused.headers["Stripe-Should-Retry"] == "true"
        assert "Retry-After" not in refused.headers
        assert limited.performed("k2") == 0


def test_an_outage_refuses_everything_until_it_ends(
    resend: FakeEmailProvider, stripe_fake: FakeStripe, http: httpx.Client
) -> None:
    resend.set_outage(True)
    stripe_fake.set_outage(True)

    assert [post_email(http, resend, f"k{i}").status_code for i in range(3)] == [503] * 3
    assert post_intent(http, stripe_fake, "k1").status_code == 503
    assert resend.performed_keys() == [] and stripe_fake.performed_keys() == []
    assert resend.outage_requests == 3

    resend.set_outage(False)
    stripe_fake.set_outage(False)
    assert post_email(http, resend, "k0").status_code == 200
    assert post_intent(http, stripe_fake, "k1").status_code == 200


def test_a_rate_limit_can_be_lifted(http: httpx.Client) -> None:
    with FakeEmailProvider(api_key=RESEND_KEY, rate_limit=1.0) as limited:
        statuses = [post_email(http, limited, f"k{i}").status_code for i in range(2)]
        assert statuses == [200, 429]
        limited.set_rate_limit(None)
        assert post_email(http, limited, "after").status_code == 200


def test_disarm_pending_drops_only_the_faults_no_request_met(
    resend: FakeEmailProvider, http: httpx.Client
) -> None:
    resend.fail_next(3, 503)
    assert post_email(http, resend, "k0").status_code == 503
    resend.drop_connection(1)
    resend.set_latency(0.01)

    assert resend.disarm_pending() == 3  # two failures and the drop
    assert post_email(http, resend, "k1").status_code == 200
    assert resend.disarm_pending() == 0


def test_disarm_pending_keeps_the_kinds_asked_and_counts_what_requests_met(
    resend: FakeEmailProvider, http: httpx.Client
) -> None:
    resend.fail_next(2, 503)
    resend.fail_next(1, 429)
    assert post_email(http, resend, "k0").status_code == 503
    resend.succeed_then_drop(2)
    assert resend.faults_met("failure") == 1 and resend.faults_met("429") == 0

    # The 503 left and the drops after performing go; the 429 stays, first in line.
    assert resend.disarm_pending(keep={"429"}) == 3
    assert post_email(http, resend, "k1").status_code == 429
    assert resend.faults_met("429") == 1 and resend.faults_met("post_drop") == 0
    assert post_email(http, resend, "k2").status_code == 200
    assert resend.disarm_pending(keep={"429", "post_drop"}) == 0
