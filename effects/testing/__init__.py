"""effects.testing: local fake providers, real HTTP servers on 127.0.0.1.

Each fake has its provider's idempotency semantics (first request performed and its
answer saved; same request replayed; another request with the key refused; a request
while the first is in flight refused), fault injection (latency, errors, timeouts after
success, dropped connections) and counters of what it really performed per key, so a
test can assert "once"::

    with FakeEmailProvider() as resend, SendEmail(api_key="re_test", base_url=resend.url) as send:
        send.perform(job)
        send.perform(job)              # a retry with the same key
        assert resend.performed(job.key) == 1

``FakeEmailProvider`` is Resend's ``POST /emails``; ``FakeStripe`` serves PaymentIntents
and Refunds to stripe-python, and sends signed webhook events (``send_event``);
``FakeWebhookReceiver`` checks Standard Webhooks signatures and deduplicates by
``webhook-id``. The pytest plugin (``effects.testing.pytest_plugin``,
registered automatically) provides them as the fixtures ``fake_email``, ``fake_stripe``
and ``fake_webhook``. Unlike stripe-mock, these fakes honour idempotency keys, which is
what the outbox's guarantees rest on.

NATS is not faked: ``NatsServer`` / ``nats_server()`` run the real ``nats-server``
binary with JetStream on 127.0.0.1 (fixture ``nats_server``), with ``stop``, ``kill``
and ``restart`` for broker faults. Kafka is librdkafka's own mock cluster
(``KafkaMockCluster``), held by a child process so a client process can be killed while
the cluster survives.
"""

from ._base import FakeProvider
from ._email import FakeEmailProvider, SentEmail
from ._faults import Hold
from ._kafka import KafkaMockCluster
from ._nats import NatsServer, find_nats_server, nats_server
from ._stripe import DEFAULT_DECLINED_CARDS, FakeStripe, stripe_signature
from ._webhook import FakeWebhookReceiver, ReceivedWebhook

__all__ = [
    "DEFAULT_DECLINED_CARDS",
    "FakeEmailProvider",
    "FakeProvider",
    "FakeStripe",
    "FakeWebhookReceiver",
    "Hold",
    "KafkaMockCluster",
    "NatsServer",
    "ReceivedWebhook",
    "SentEmail",
    "find_nats_server",
    "nats_server",
    "stripe_signature",
]
