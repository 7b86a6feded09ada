"""Constants and job builders shared by the adapter tests."""

from __future__ import annotations

import threading
from typing import Any, Self

import standardwebhooks
from pydantic import BaseModel

import outbox
from effects.testing._http import LocalServer, Reply, Request

RESEND_KEY = "re_test_SECRET_c0ffee0123456789"
STRIPE_KEY = "sk_test_SECRET_51Hc0ffee0123456789"
WEBHOOK_SECRET = "whsec_SECRETc0ffee0123456789"
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


class LibraryReceiver:
    """A webhook endpoint that verifies with the ``standardwebhooks`` library itself.

    401 unless ``Webhook.verify`` accepts the request; ``verified`` lists the parsed
    bodies it accepted and ``ids`` their ``webhook-id`` headers.
    """

    def __init__(self, library: standardwebhooks.Webhook) -> None:
        self._library = library
        self._lock = threading.Lock()
        self.verified: list[Any] = []
        self.ids: list[str] = []
        self._server = LocalServer(self._answer, name="library-receiver")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.port}/hook"

    def _answer(self, request: Request) -> Reply:
        try:
            document = self._library.verify(request.body, dict(request.headers))
        except standardwebhooks.WebhookVerificationError:
            return Reply.json(401, {"error": "invalid_signature"})
        with self._lock:
            self.verified.append(document)
            self.ids.append(request.headers["webhook-id"])
        return Reply.json(200, {"ok": True})

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.close()
