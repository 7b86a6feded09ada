"""A Stripe webhook view of the test app: each event handled once, in the request's
transaction (``ATOMIC_REQUESTS``), with ``effects.inbox`` on the Django route."""

from __future__ import annotations

from django.db import models
from django.http import HttpRequest, HttpResponseBadRequest, JsonResponse
from django.urls import path

from effects.inbox import WebhookRejected, receive_stripe_event
from outbox.contrib.django import transaction as outbox_atomic

STRIPE_WEBHOOK_SECRET = "whsec_djangoshop_endpoint"


class Payment(models.Model):
    """A payment the shop recorded from Stripe: one row per event handled."""

    order: models.IntegerField[int, int] = models.IntegerField()
    intent: models.CharField[str, str] = models.CharField(max_length=255)

    class Meta:
        app_label = "djangoshop"
        db_table = "djangoshop_payment"


def stripe_webhook(request: HttpRequest) -> HttpResponseBadRequest | JsonResponse:
    """``payment_intent.succeeded`` records the order's payment, once per event id."""
    try:
        with outbox_atomic() as tx:  # a savepoint of the request's transaction
            got = receive_stripe_event(tx, "djangoshop.stripe", request.body, request.headers,
                                       secret=STRIPE_WEBHOOK_SECRET)
            if got.new and got.event.type == "payment_intent.succeeded":
                intent = got.event.data.object
                Payment.objects.create(order=int(intent.metadata["order_id"]), intent=intent.id)
    except WebhookRejected as exc:  # forged, stale or not JSON: nothing was recorded
        return HttpResponseBadRequest(str(exc))
    return JsonResponse({"event": got.message_id, "new": got.new})


urlpatterns = [path("webhooks/stripe", stripe_webhook)]
