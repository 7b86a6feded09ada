"""Incoming webhooks, handled once: verify the signature and record the id in one call.

Each helper checks the request's signature, then calls ``tx.receive(consumer, id)`` in
the caller's transaction and returns a ``Received``: ``new`` is True the first time
this consumer sees the id, False for a redelivery (whose work already committed)::

    with outbox.transaction(conn) as tx:                      # or the ORM's transaction
        got = receive_stripe_event(tx, "shop", body, request.headers, secret=WHSEC)
        if got.new:
            mark_paid(tx, got.event["data"]["object"]["id"])  # once per Stripe event

A forged, stale or malformed request raises ``WebhookRejected`` (answer it with 400)
before anything is written. Verification uses the raw body exactly as received.

    receive_webhook        Standard Webhooks (``webhook-id``, ``webhook-timestamp``,
                           ``webhook-signature``), as ``PostWebhook`` and Svix send
    receive_stripe_event   Stripe's ``Stripe-Signature``, checked by the stripe library

``areceive_webhook`` and ``areceive_stripe_event`` are the same for an
``outbox.AsyncTransaction``. The id recorded is the webhook's ``webhook-id`` or the
Stripe event's ``id`` (``evt_...``): Stripe re-sends an event with the same id, so a
retry is recognised.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import stripe

from ._signing import DEFAULT_TOLERANCE, WebhookSecret, verify_headers
from .payments import KEY_METADATA

__all__ = [
    "Received",
    "WebhookRejected",
    "areceive_stripe_event",
    "areceive_webhook",
    "receive_stripe_event",
    "receive_webhook",
    "verify_stripe_event",
    "verify_webhook",
]


class WebhookRejected(ValueError):
    """The request is not a valid signed webhook: answer 400 and record nothing.

    The message says what was wrong (missing header, bad signature, stale timestamp,
    body not JSON) and never repeats the secret or the body.
    """

    status_code = 400


@dataclass(frozen=True)
class Received:
    """A verified webhook: its id, whether it is new to this consumer, and its event.

    ``event`` is the parsed JSON body (a ``dict``) for Standard Webhooks and the
    ``stripe.Event`` for Stripe (which also reads like a dict).
    """

    message_id: str
    new: bool
    event: Any
    # A Stripe event about a PaymentIntent tagged with a job key (``ChargeCard``): the
    # id of the job it resolved as performed, if one was waiting for that answer.
    resolved_job: int | None = None


class _Receives(Protocol):
    def receive(self, consumer: str, message_id: str) -> bool: ...

    def resolve_performed(self, key: str, result: Mapping[str, Any] | None, *,
                          source: str) -> int | None: ...


class _ReceivesAsync(Protocol):
    def receive(self, consumer: str, message_id: str) -> Awaitable[bool]: ...

    def resolve_performed(self, key: str, result: Mapping[str, Any] | None, *,
                          source: str) -> Awaitable[int | None]: ...


def verify_webhook(
    secret: WebhookSecret | Sequence[WebhookSecret],
    body: bytes | str,
    headers: Mapping[str, str],
    tolerance: float = DEFAULT_TOLERANCE,
) -> tuple[str, Any]:
    """The ``webhook-id`` and parsed JSON body of a Standard Webhooks request.

    Raises ``WebhookRejected`` when the signature does not hold for any of ``secret``
    (one or several, as during a rotation) or the timestamp is more than ``tolerance``
    seconds away.
    """
    message_id = verify_headers(secret, headers, body, tolerance)
    if message_id is None:
        raise WebhookRejected(
            "webhook signature, id or timestamp missing or invalid "
            "(headers webhook-id, webhook-timestamp, webhook-signature)"
        )
    try:
        return message_id, json.loads(body)
    except ValueError as exc:
        raise WebhookRejected(f"webhook {message_id}: body is not JSON") from exc


def verify_stripe_event(
    secret: str, body: bytes | str, signature: str | None, tolerance: int = 300
) -> stripe.Event:
    """The Stripe event of a request, verified by ``stripe.Webhook.construct_event``.

    ``signature`` is the ``Stripe-Signature`` header. Raises ``WebhookRejected``.
    """
    try:
        event: stripe.Event = stripe.Webhook.construct_event(body, signature, secret, tolerance)
    except stripe.SignatureVerificationError as exc:
        raise WebhookRejected("Stripe-Signature missing or invalid, or the event is "
                              "too old") from exc
    except ValueError as exc:
        raise WebhookRejected("Stripe webhook body is not a JSON event") from exc
    return event


def receive_webhook(
    tx: _Receives,
    consumer: str,
    body: bytes | str,
    headers: Mapping[str, str],
    *,
    secret: WebhookSecret | Sequence[WebhookSecret],
    tolerance: float = DEFAULT_TOLERANCE,
) -> Received:
    """Verify a Standard Webhooks request and record its ``webhook-id`` in ``tx``.

    ``tx`` is any outbox transaction (``outbox.transaction``, the SQLAlchemy or Django
    ones). Nothing is recorded for a rejected request.
    """
    message_id, event = verify_webhook(secret, body, headers, tolerance)
    return Received(message_id, tx.receive(consumer, message_id), event)


async def areceive_webhook(
    tx: _ReceivesAsync,
    consumer: str,
    body: bytes | str,
    headers: Mapping[str, str],
    *,
    secret: WebhookSecret | Sequence[WebhookSecret],
    tolerance: float = DEFAULT_TOLERANCE,
) -> Received:
    """``receive_webhook`` for an ``outbox.AsyncTransaction``."""
    message_id, event = verify_webhook(secret, body, headers, tolerance)
    return Received(message_id, await tx.receive(consumer, message_id), event)


def receive_stripe_event(
    tx: _Receives,
    consumer: str,
    body: bytes | str,
    headers: Mapping[str, str],
    *,
    secret: str,
    tolerance: int = 300,
) -> Received:
    """Verify a Stripe webhook (``Stripe-Signature``) and record the event id in ``tx``.

    A new event about a settled PaymentIntent whose metadata names a job key
    (``outbox_key``, as ``ChargeCard`` tags every intent) resolves that job as performed
    in the same transaction (``tx.resolve_performed``): a charge whose answer was lost
    is recorded from Stripe's own word, without asking Stripe again.
    """
    event = verify_stripe_event(secret, body, _header(headers, "stripe-signature"), tolerance)
    new = tx.receive(consumer, event.id)
    resolved = None
    if new and (performed := _performed_charge(event)) is not None:
        resolved = tx.resolve_performed(*performed, source=f"stripe event {event.id}")
    return Received(event.id, new, event, resolved)


async def areceive_stripe_event(
    tx: _ReceivesAsync,
    consumer: str,
    body: bytes | str,
    headers: Mapping[str, str],
    *,
    secret: str,
    tolerance: int = 300,
) -> Received:
    """``receive_stripe_event`` for an ``outbox.AsyncTransaction``."""
    event = verify_stripe_event(secret, body, _header(headers, "stripe-signature"), tolerance)
    new = await tx.receive(consumer, event.id)
    resolved = None
    if new and (performed := _performed_charge(event)) is not None:
        resolved = await tx.resolve_performed(*performed, source=f"stripe event {event.id}")
    return Received(event.id, new, event, resolved)


# PaymentIntent events that mean the charge was made (the statuses ChargeCard records).
_PERFORMED_EVENTS = frozenset({"payment_intent.succeeded", "payment_intent.processing",
                               "payment_intent.amount_capturable_updated"})


def _performed_charge(event: Any) -> tuple[str, dict[str, Any]] | None:
    """(job key, ledger result) for an event saying a tagged charge was made, else None;
    the result has the shape ``ChargeCard.perform`` returns."""
    if getattr(event, "type", None) not in _PERFORMED_EVENTS:
        return None
    intent = event.data.object
    metadata = getattr(intent, "metadata", None)
    key = getattr(metadata, KEY_METADATA, None) if metadata is not None else None
    if not isinstance(key, str) or not key:
        return None
    return key, {"id": intent.id, "status": intent.status, "amount": intent.amount,
                 "currency": intent.currency}


def _header(headers: Mapping[str, str], name: str) -> str | None:
    # Framework header mappings are case-insensitive; plain dicts are not.
    for key, value in headers.items():
        if key.lower() == name:
            return value
    return None
