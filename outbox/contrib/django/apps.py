"""The Django app of outbox: ``INSTALLED_APPS = [..., "outbox.contrib.django"]``."""

from __future__ import annotations

from django.apps import AppConfig
from django.db.models.signals import post_migrate


class OutboxConfig(AppConfig):
    """Creates the outbox tables under ``manage.py migrate`` (and in the test runner's
    database), upgrades them on every later ``migrate``, empties them on ``flush`` (so
    each ``TransactionTestCase`` starts with no job left by another), and registers the
    ``manage.py outbox`` command."""

    name = "outbox.contrib.django"
    label = "outbox"
    verbose_name = "Outbox"

    def ready(self) -> None:
        from ._schema import after_migrate

        post_migrate.connect(after_migrate, sender=self,
                             dispatch_uid="outbox.contrib.django.after_migrate")
