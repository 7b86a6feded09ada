"""Fan-in on real PostgreSQL with the real adapters against the fakes of
``effects.testing``: an email (fast) and a webhook (about a second) then a child
``after=[both]``."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import psycopg
import pytest

import outbox
from effects.email import SendEmail
from effects.testing import FakeEmailProvider, FakeWebhookReceiver
from effects.webhook import PostWebhook

from .support import NOTIFIED, MarkNotified, job_row, ledger_row

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
EMAIL = {"from": "shop@example.com", "to": "ada@example.com", "subject": "Order 102",
         "text": "Thank you."}
HOOK = {"event": "order.paid", "data": {"order": 102}}


@dataclass
class Shop:
    dsn: str
    schema: str
    resend: FakeEmailProvider
    receiver: FakeWebhookReceiver
    child: MarkNotified
    effects: list[outbox.Effect]

    def enqueue(self, key: str, effect: str, payload: Mapping[str, object],
                after: list[str] | None = None) -> outbox.EnqueueResult:
        with psycopg.connect(self.dsn) as conn, \
                outbox.transaction(conn, schema=self.schema) as tx:
            return tx.enqueue(effect, key=key, payload=payload, after=after)

    def drain(self) -> outbox.DispatchStats:
        dispatcher = outbox.Dispatcher(self.dsn, effects=self.effects, schema=self.schema,
                                       lease=10.0, concurrency=4)
        return dispatcher.run_until_idle(timeout=60)


@pytest.fixture
def shop(dsn: str, schema: str) -> Iterator[Shop]:
    with FakeEmailProvider(api_key="re_test") as resend, \
            FakeWebhookReceiver(SECRET, latency=1.0) as receiver, \
            SendEmail(api_key="re_test", base_url=resend.url) as email, \
            PostWebhook(url=receiver.url, secret=SECRET) as webhook:
        child = MarkNotified(dsn, schema)
        yield Shop(dsn, schema, resend, receiver, child, [email, webhook, child])


def test_child_runs_once_after_both_parents_with_their_results(shop: Shop) -> None:
    with psycopg.connect(shop.dsn) as conn, outbox.transaction(conn, schema=shop.schema) as tx:
        tx.enqueue("email.send", key="email-102", payload=EMAIL)
        tx.enqueue("webhook.post", key="hook-102", payload=HOOK)
        child = tx.enqueue(NOTIFIED, key="notified-102", payload={"order": 102},
                           after=["email-102", "hook-102"])
    assert child.created
    waiting = job_row(shop.dsn, shop.schema, "notified-102")
    assert (waiting["status"], waiting["after_waiting"]) == ("pending", 2)

    shop.drain()

    [(results, recorded)] = shop.child.performs("notified-102")
    assert {"email-102", "hook-102"} <= recorded  # both parents were done when it ran
    email, hook = ledger_row(shop.dsn, shop.schema, "email-102"), ledger_row(
        shop.dsn, shop.schema, "hook-102")
    assert email is not None and hook is not None
    assert results == {"email-102": email["result"], "hook-102": hook["result"]}
    assert results["email-102"]["id"]  # Resend's id for the email, as its ledger row holds
    done = job_row(shop.dsn, shop.schema, "notified-102")
    assert done["status"] == "done" and done["attempts"] == 1
    assert done["first_attempted_at"] > max(email["recorded_at"], hook["recorded_at"])
    assert shop.resend.performed("email-102") == 1
    assert shop.receiver.performed("hook-102") == 1


def test_webhook_failing_for_good_fails_the_child_unperformed(shop: Shop) -> None:
    shop.receiver.fail_next(1, status=400)  # a 4xx: permanent
    with psycopg.connect(shop.dsn) as conn, outbox.transaction(conn, schema=shop.schema) as tx:
        tx.enqueue("email.send", key="email-103", payload=EMAIL)
        tx.enqueue("webhook.post", key="hook-103", payload=HOOK)
        tx.enqueue(NOTIFIED, key="notified-103", payload={"order": 103},
                   after=["email-103", "hook-103"])

    shop.drain()

    assert job_row(shop.dsn, shop.schema, "hook-103")["status"] == "failed"
    child = job_row(shop.dsn, shop.schema, "notified-103")
    assert child["status"] == "failed"
    assert "hook-103" in child["last_error"] and child["attempts"] == 0
    assert shop.child.performs("notified-103") == []
    assert ledger_row(shop.dsn, shop.schema, "notified-103") is None


def test_parents_done_in_an_earlier_transaction_make_the_child_due_at_once(
        shop: Shop) -> None:
    shop.enqueue("email-104", "email.send", EMAIL)
    shop.enqueue("hook-104", "webhook.post", HOOK)
    shop.drain()

    shop.enqueue("notified-104", NOTIFIED, {"order": 104}, after=["email-104", "hook-104"])
    child = job_row(shop.dsn, shop.schema, "notified-104")
    assert (child["status"], child["after_waiting"]) == ("pending", 0)
    with psycopg.connect(shop.dsn, autocommit=True) as conn:
        due = conn.execute("SELECT now() >= %s", (child["available_at"],)).fetchone()
    assert due == (True,)

    stats = shop.drain()

    assert stats.done == 1
    [(results, _)] = shop.child.performs("notified-104")
    assert set(results) == {"email-104", "hook-104"}


def test_a_child_that_runs_anyway_sees_which_parent_failed(shop: Shop) -> None:
    shop.receiver.fail_next(1, status=400)  # the webhook fails for good
    with psycopg.connect(shop.dsn) as conn, outbox.transaction(conn, schema=shop.schema) as tx:
        tx.enqueue("email.send", key="email-105", payload=EMAIL)
        tx.enqueue("webhook.post", key="hook-105", payload=HOOK)
        tx.enqueue(NOTIFIED, key="notified-105", payload={"order": 105},
                   after=["email-105", "hook-105"], after_failed="run")

    shop.drain()

    [(results, recorded)] = shop.child.performs("notified-105")
    assert "email-105" in recorded
    email = ledger_row(shop.dsn, shop.schema, "email-105")
    assert email is not None and results["email-105"] == email["result"]
    failed = results["hook-105"]
    assert isinstance(failed, outbox.FailedParent) and failed.key == "hook-105"
    assert failed.error and "400" in failed.error
    assert job_row(shop.dsn, shop.schema, "notified-105")["status"] == "done"
