"""effects: adapters that perform outbox jobs against real providers.

Each adapter sends the job's key, unchanged, as the provider's idempotency key, so
the at-least-once delivery of the dispatcher becomes one effect at the provider::

    SendEmail       "email.send"      Resend's POST /emails, over httpx
    ChargeCard      "payment.charge"  Stripe PaymentIntent, created and confirmed
    RefundPayment   "payment.refund"  Stripe Refund
    PostWebhook     "webhook.post"    JSON POST to any endpoint, signed per Standard Webhooks

With the ``outbox-pg[nats]`` extra, ``effects.nats`` adds ``PublishEvent`` ("nats.publish",
JetStream deduplicated by the key) and the ``InboxConsumer``. With ``outbox-pg[kafka]``,
``effects.kafka`` adds ``Produce`` ("kafka.produce", an idempotent producer; Kafka does
not deduplicate by our key, consumers do) and an ``InboxConsumer`` that keeps partition
offsets in PostgreSQL. ``envelope="cloudevents"`` makes NATS, Kafka and webhook messages
CloudEvents in binary mode. ``effects.inbox`` verifies incoming Standard Webhooks and
Stripe webhooks and records them through ``tx.receive``.

Each maps its provider's answers to ``outbox.Retry``, ``outbox.Permanent`` or
``outbox.UnknownOutcome`` (tables in each module's docstring). ``effects.testing`` has
local fake providers with the same idempotency semantics, for tests.
"""

from .email import EmailPayload, EmailTag, SendEmail
from .payments import ChargeCard, ChargePayload, RefundPayload, RefundPayment
from .webhook import (
    PostWebhook,
    WebhookPayload,
    compute_signature,
    generate_secret,
    verify_headers,
    verify_signature,
)

__all__ = [
    "ChargeCard",
    "ChargePayload",
    "EmailPayload",
    "EmailTag",
    "PostWebhook",
    "RefundPayload",
    "RefundPayment",
    "SendEmail",
    "WebhookPayload",
    "compute_signature",
    "generate_secret",
    "verify_headers",
    "verify_signature",
]
