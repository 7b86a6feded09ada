"""URLs of the test app."""

from __future__ import annotations

from django.urls import path

from .views import place_order

urlpatterns = [path("orders/<int:order_id>", place_order)]
