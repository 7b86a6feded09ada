"""A view that places an order and enqueues its email, under ``ATOMIC_REQUESTS``."""

from __future__ import annotations

from django.http import HttpRequest, JsonResponse

from outbox.contrib.django import transaction as outbox_atomic

from .models import Order


def place_order(request: HttpRequest, order_id: int) -> JsonResponse:
    """Write the order, enqueue its email; ``?fail=1`` raises after both (rolls back)."""
    Order.objects.create(id=order_id)
    with outbox_atomic() as tx:
        tx.enqueue("email.send", key=f"email-order-{order_id}", payload={"order": order_id})
    if request.GET.get("fail"):
        raise RuntimeError("the view failed after enqueueing")
    return JsonResponse({"order": order_id})
