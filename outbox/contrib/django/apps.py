"""The Django app of outbox: ``INSTALLED_APPS = [..., "outbox.contrib.django"]``."""

from __future__ import annotations

from django.apps import AppConfig


class OutboxConfig(AppConfig):
    """Registers the ``manage.py outbox`` command; the app has no models (the outbox
    tables are created by ``manage.py outbox migrate``, not by Django migrations)."""

    name = "outbox.contrib.django"
    label = "outbox"
    verbose_name = "Outbox"
