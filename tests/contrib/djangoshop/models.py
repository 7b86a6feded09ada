"""The test app's one model."""

from __future__ import annotations

from django.db import models


class Order(models.Model):
    """An order; its id is chosen by the test."""

    id: models.IntegerField[int, int] = models.IntegerField(primary_key=True)

    class Meta:
        app_label = "djangoshop"
        db_table = "djangoshop_order"
