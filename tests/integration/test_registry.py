"""Registered effects: a typo'd effect name or a payload its model rejects raises at
enqueue, inside the business transaction, before anything is written."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from pydantic import BaseModel

import outbox
from effects.email import EmailPayload, SendEmail
from outbox import InvalidPayload, NewJob, UnknownEffect
from outbox.registry import clear_registered_effects, registered_effects
from outbox.testing import jobs

EMAIL = {"from": "shop@example.com", "to": "ada@example.com", "subject": "Hi",
         "text": "Thank you!"}


@pytest.fixture
def registered() -> Iterator[None]:
    outbox.register_effects(SendEmail, "audit.log")
    try:
        yield
    finally:
        clear_registered_effects()


def test_a_typo_raises_in_the_transaction_naming_the_effect_meant(
    dsn: str, schema: str, registered: None
) -> None:
    assert dict(registered_effects()) == {"email.send": EmailPayload, "audit.log": None}
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        with pytest.raises(UnknownEffect) as refused:
            tx.enqueue("email.sned", key="k1", payload=EMAIL)
        assert str(refused.value) == ("effect 'email.sned' is not registered (registered: "
                                      "audit.log, email.send); did you mean 'email.send'?")
        with pytest.raises(UnknownEffect, match=r"job #1 \('k3'\): effect 'pay.charge'"):
            tx.enqueue_many([NewJob("audit.log", "k2", {}), NewJob("pay.charge", "k3", {})])
        # Refused before anything was sent: the transaction goes on.
        tx.enqueue("email.send", key="ok", payload=EMAIL)
        tx.enqueue("audit.log", key="any", payload={"anything": [1, 2]})
    assert sorted(jobs(dsn, schema)) == ["any", "ok"]


def test_a_payload_its_model_rejects_raises_naming_the_fields(
    dsn: str, schema: str, registered: None
) -> None:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        with pytest.raises(InvalidPayload) as refused:
            tx.enqueue("email.send", key="k1", payload={"order": 102})
        message = str(refused.value)
        assert message.startswith("payload invalid for effect 'email.send' (EmailPayload): ")
        assert "from: Field required" in message and "order: Extra inputs" in message
        with pytest.raises(InvalidPayload, match=r"must be a EmailPayload \(or a mapping of "
                                                 r"its fields\), got a NewJobModel"):
            tx.enqueue("email.send", key="k2", payload=NewJobModel())
        model = EmailPayload.model_validate(EMAIL)
        assert tx.enqueue("email.send", key="k3", payload=model).created
    assert list(jobs(dsn, schema)) == ["k3"]


def test_without_registrations_any_effect_is_taken(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        assert tx.enqueue("email.sned", key="k", payload={}).created


class NewJobModel(BaseModel):
    """Some other model than the effect's."""

    x: int = 1
