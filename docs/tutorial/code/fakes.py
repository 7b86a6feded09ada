"""Stand-ins for Stripe and Resend on this machine: real HTTP servers with the providers'
idempotency rules (``effects.testing``), so the tutorial needs no account. Resend's
default limit, 2 requests per second, is enforced as Resend does (429)."""

import contextlib
import threading

from effects.testing import FakeEmailProvider, FakeStripe

with FakeStripe() as stripe, FakeEmailProvider(rate_limit=2.0) as resend:
    print(f"export STRIPE_BASE_URL={stripe.url} STRIPE_API_KEY=sk_test_tutorial")
    print(f"export RESEND_BASE_URL={resend.url} RESEND_API_KEY=re_tutorial")
    print("Ctrl-C stops them.", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        threading.Event().wait()
