"""The official ``resend`` SDK against ``FakeEmailProvider``: send, get, list, batch,
cancel and template sends answer as Resend does, none with a 404."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import resend

from effects.testing import FakeEmailProvider

from ._support import RESEND_KEY

MESSAGE: Any = {"from": "Shop <orders@shop.example>", "to": ["ada@example.com"],
                "subject": "Order 102", "text": "Thanks!"}


def message(**changes: Any) -> Any:
    """``MESSAGE`` with ``changes`` (typed loosely: the SDK's TypedDicts are strict)."""
    return {**MESSAGE, **changes}


@pytest.fixture
def sdk(resend: FakeEmailProvider) -> Iterator[FakeEmailProvider]:
    """The SDK's module settings pointed at the fake, restored afterwards."""
    import resend as resend_sdk

    saved = (resend_sdk.api_key, resend_sdk.api_url)
    resend_sdk.api_key, resend_sdk.api_url = RESEND_KEY, resend.url
    try:
        yield resend
    finally:
        resend_sdk.api_key, resend_sdk.api_url = saved


def test_send_get_and_list(sdk: FakeEmailProvider) -> None:
    first = resend.Emails.send(MESSAGE, options={"idempotency_key": "email-order-102"})
    again = resend.Emails.send(MESSAGE, options={"idempotency_key": "email-order-102"})
    assert first["id"] == again["id"] and len(sdk.sent_emails) == 1
    second = resend.Emails.send(message(subject="Order 103", html="<p>Hi</p>"))

    got = resend.Emails.get(first["id"])
    assert (got["id"], got["subject"], got["text"], got["to"]) == (
        first["id"], "Order 102", "Thanks!", ["ada@example.com"])
    assert got["last_event"] == "delivered" and got["from"] == MESSAGE["from"]

    listed = resend.Emails.list()
    assert [e["id"] for e in listed["data"]] == [second["id"], first["id"]]
    assert listed["has_more"] is False and "text" not in listed["data"][0]
    page = resend.Emails.list({"limit": 1})
    assert [e["id"] for e in page["data"]] == [second["id"]] and page["has_more"]
    rest = resend.Emails.list({"limit": 1, "after": second["id"]})
    assert [e["id"] for e in rest["data"]] == [first["id"]]
    with pytest.raises(resend.exceptions.ResendError):
        resend.Emails.get("00000000-0000-0000-0000-000000000000")


def test_batch_with_an_idempotency_key(sdk: FakeEmailProvider) -> None:
    batch: Any = [MESSAGE, message(to="bob@example.com")]
    sent = resend.Batch.send(batch, options={"idempotency_key": "batch-1"})
    replayed = resend.Batch.send(batch, options={"idempotency_key": "batch-1"})
    assert [e["id"] for e in sent["data"]] == [e["id"] for e in replayed["data"]]
    assert len(sent["data"]) == 2 == len(sdk.sent_emails)
    assert resend.Emails.get(sent["data"][1]["id"])["to"] == ["bob@example.com"]
    with pytest.raises(resend.exceptions.ResendError):  # same key, other batch: 409
        resend.Batch.send(batch[:1], options={"idempotency_key": "batch-1"})
    with pytest.raises(resend.exceptions.ResendError):  # one bad email refuses them all
        resend.Batch.send([MESSAGE, message(to=None, subject=None)])
    assert len(sdk.sent_emails) == 2


def test_cancel_a_scheduled_email(sdk: FakeEmailProvider) -> None:
    later = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    scheduled = resend.Emails.send(message(scheduled_at=later))
    assert resend.Emails.get(scheduled["id"])["last_event"] == "scheduled"
    canceled = resend.Emails.cancel(scheduled["id"])
    assert canceled["id"] == scheduled["id"]
    assert resend.Emails.get(scheduled["id"])["last_event"] == "canceled"
    sent = resend.Emails.send(MESSAGE)
    with pytest.raises(resend.exceptions.ResendError, match="scheduled"):
        resend.Emails.cancel(sent["id"])


def test_template_send(sdk: FakeEmailProvider) -> None:
    sdk.add_template("order-receipt", subject="Receipt for {{{ORDER}}}",
                     html="<p>Paid with {{{INTENT}}}</p>")
    template: Any = {"from": MESSAGE["from"], "to": "ada@example.com",
                     "template": {"id": "order-receipt",
                                  "variables": {"ORDER": "102", "INTENT": "pi_1"}}}
    sent = resend.Emails.send(template)
    got = resend.Emails.get(sent["id"])
    assert (got["subject"], got["html"]) == ("Receipt for 102", "<p>Paid with pi_1</p>")
    with pytest.raises(resend.exceptions.ResendError, match="not found"):
        resend.Emails.send(message(template={"id": "nope"}, text=None))
