"""Constants and job builders shared by the adapter tests."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

import outbox

RESEND_KEY = "re_test_SECRET_c0ffee0123456789"
STRIPE_KEY = "sk_test_SECRET_51Hc0ffee0123456789"
WEBHOOK_SECRET = "whsec_SECRET_c0ffee0123456789"
SECRETS = (RESEND_KEY, STRIPE_KEY, WEBHOOK_SECRET)

# Generous for a loopback call, yet far below pytest's own timeout.
TIMEOUT = 5.0
# Short enough to make a stalled answer a timeout quickly.
SHORT_TIMEOUT = 0.3


def make_job(
    effect: str, key: str, payload: dict[str, Any], model: BaseModel | None = None
) -> outbox.Job:
    """A job as the dispatcher would hand it over, first attempt."""
    return outbox.Job(
        id=1, effect=effect, key=key, payload=payload, attempt=1, claim_version=1, model=model
    )


def email_payload(**changes: Any) -> dict[str, Any]:
    """A valid ``email.send`` payload, with ``changes`` applied (None removes a field)."""
    payload: dict[str, Any] = {
        "from": "Shop <orders@shop.example>",
        "to": ["ada@example.com"],
        "subject": "Your order 102",
        "text": "Thanks for your order.",
    }
    return _apply(payload, changes)


def charge_payload(**changes: Any) -> dict[str, Any]:
    """A valid ``payment.charge`` payload, with ``changes`` applied (None removes a field)."""
    payload: dict[str, Any] = {
        "amount": 2000,
        "currency": "eur",
        "customer": "cus_Ada",
        "payment_method": "pm_card_visa",
        "metadata": {"order": "102"},
    }
    return _apply(payload, changes)


def _apply(payload: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    for name, value in changes.items():
        if value is None:
            payload.pop(name, None)
        else:
            payload[name] = value
    return payload
