"""Between bursts the chaos injector drops the provider faults no request met, except a
kind never met anywhere in the run yet: else a run can end with a fault enabled and
never injected (the effect it was armed for paused each time its burst came)."""

from __future__ import annotations

import httpx

from effects.chaos.faults import disarm_unmet
from effects.testing import FakeEmailProvider, FakeProvider, FakeStripe
from tests.effects._support import RESEND_KEY, STRIPE_KEY, TIMEOUT, email_payload


def send(http: httpx.Client, fake: FakeEmailProvider, key: str) -> int:
    headers = {"Authorization": f"Bearer {RESEND_KEY}", "Idempotency-Key": key}
    return http.post(f"{fake.url}/emails", json=email_payload(), headers=headers).status_code


def test_an_unmet_fault_of_a_kind_never_injected_stays_armed_until_a_request_meets_it(
) -> None:
    with FakeEmailProvider(api_key=RESEND_KEY) as email, \
            FakeStripe(api_key=STRIPE_KEY) as stripe_fake, \
            httpx.Client(timeout=TIMEOUT) as http:
        fakes: dict[str, FakeProvider] = {"email": email, "stripe": stripe_fake}
        armed = {"failure", "post_drop"}
        email.fail_next(2, 503)
        email.succeed_then_drop(1)
        assert send(http, email, "k0") == 503  # one 5xx met: that kind has been injected

        # The next burst at email: the 5xx left goes, the drop never met stays.
        assert disarm_unmet(fakes, "email", armed) == 1
        assert email.faults_met("post_drop") == 0
        try:
            send(http, email, "k1")
        except httpx.TransportError:
            pass
        else:
            raise AssertionError("the kept drop did not meet the next request")
        assert email.faults_met("post_drop") == 1
        assert send(http, email, "k2") == 200  # nothing else was left armed

        # Once met anywhere, a kind's unmet faults go at the next burst like any other.
        stripe_fake.succeed_then_drop(2)
        stripe_fake.fail_next(1, 503)
        assert disarm_unmet(fakes, "stripe", armed) == 3
