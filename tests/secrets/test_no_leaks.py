"""API keys never reach logs, exceptions, ``last_error`` or the ledger, and payload
contents never reach logs, while real Dispatchers run the adapters against fake providers
that fail in every way they can (5xx, 429, a refused key, a declined card, a timeout after
the provider acted).

stripe-python's own logging is switched fully on (``stripe.log = "debug"``, which also
prints to stderr, and its ``stripe`` logger at DEBUG). What it was found to log: at INFO
the method, URL and status of each request and the error code and message of each error
answer; at DEBUG also the form-encoded request body ("Post details": every PaymentIntent
parameter, so description, metadata and customer id) and the response body. It never
logs request headers, so the API key (sent only as ``Authorization: Bearer``) does not
appear at any level. The request body at DEBUG is why ``effects.payments`` says to keep
the ``stripe`` logger at INFO where payloads hold personal data; the last test pins that.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from contextlib import closing
from typing import Any

import psycopg
import pytest
import stripe

import outbox
from effects.testing import FakeEmailProvider, FakeStripe, FakeWebhookReceiver
from outbox import Backoff, Dispatcher, DispatchStats, Effect
from outbox.testing import jobs as job_rows

from ._support import (
    PII,
    RESEND_KEY,
    SECRETS,
    STRIPE_KEY,
    WEBHOOK_SECRET,
    RecordingCharge,
    RecordingEmail,
    RecordingWebhook,
    capture_everything,
    exception_texts,
    log_texts,
    logged_about,
    stored_texts,
)

TIMEOUT = 0.5  # the adapters' HTTP timeout: a stalled answer becomes UnknownOutcome fast
# No delay: run_until_idle does not wait for retries that are not due yet, and a second
# dispatcher (the refused-key one) must not pick up the first one's retries.
BACKOFF = Backoff(base=0.0, cap=0.0)


@pytest.fixture(autouse=True)
def stripe_debug(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """stripe-python logging fully on, and every logger captured at DEBUG."""
    monkeypatch.setattr(stripe, "log", "debug")
    capture_everything(caplog)


def _enqueue(dsn: str, schema: str, effect: str, payloads: dict[str, dict[str, Any]]) -> None:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        for key, payload in payloads.items():
            tx.enqueue(effect, key=key, payload=payload, max_attempts=6)


def _dispatch(dsn: str, schema: str, adapter: Effect) -> DispatchStats:
    dispatcher = Dispatcher(dsn, [adapter], schema=schema, backoff=BACKOFF)
    return dispatcher.run_until_idle(timeout=60)


def _assert_nothing_leaked(
    dsn: str,
    schema: str,
    records: list[logging.LogRecord],
    stderr: str,
    errors: Iterable[BaseException],
    *,
    pii_free_logs: bool = True,
) -> None:
    for secret in SECRETS:
        in_logs = [f"{r.name}: {text}" for r, text in log_texts(records) if secret in text]
        assert not in_logs, f"{secret} logged: {in_logs[:3]}"
        assert secret not in stderr
        in_errors = [text for text in exception_texts(errors) if secret in text]
        assert not in_errors, f"{secret} in an exception: {in_errors[:3]}"
        in_rows = [text for text in stored_texts(dsn, schema) if secret in text]
        assert not in_rows, f"{secret} stored: {in_rows[:3]}"
    if pii_free_logs:
        with_pii = [f"{r.name}: {text}" for r, text in log_texts(records) if PII in text]
        assert not with_pii, f"payload contents logged: {with_pii[:3]}"
    for key, row in job_rows(dsn, schema).items():
        assert PII not in (row["last_error"] or ""), key


def _assert_logs_name_the_troubled_jobs(dsn: str, schema: str, records: list[Any]) -> None:
    """Every job that failed or was retried is named in the logs by id and key."""
    troubled = 0
    for key, row in job_rows(dsn, schema).items():
        if row["status"] != "done" or row["attempts"] > 1:
            troubled += 1
            assert logged_about(records, f"job {row['id']} (key {key})"), key
    assert troubled >= 3


def _assert_loggers_were_heard(records: list[logging.LogRecord], *prefixes: str) -> None:
    """The capture really covered these libraries (else 'nothing leaked' proves nothing)."""
    names = {record.name for record in records}
    for prefix in prefixes:
        assert any(name.startswith(prefix) for name in names), (prefix, sorted(names))


def _email(n: int) -> dict[str, Any]:
    return {
        "from": "shop@example.com",
        "to": f"{PII}.{n}@example.com",
        "subject": f"Your order {n} for {PII}",
        "text": f"Dear {PII}, order {n} ships today.",
    }


def test_email(dsn: str, schema: str, caplog: pytest.LogCaptureFixture,
               capsys: pytest.CaptureFixture[str]) -> None:
    good = {f"email-{n}": _email(n) for n in range(4)}
    invalid = {**_email(9), "html": 5, "nickname": PII}
    _enqueue(dsn, schema, "email.send", {**good, "email-invalid": invalid})
    with (
        FakeEmailProvider(api_key=RESEND_KEY) as resend,
        closing(RecordingEmail(RESEND_KEY, resend.url, TIMEOUT)) as adapter,
    ):
        resend.fail_next(2, 503)
        resend.fail_next(1, 429, retry_after=0)
        resend.succeed_then_timeout(1)
        stats = _dispatch(dsn, schema, adapter)
        assert [resend.performed(key) for key in good] == [1] * 4
    _enqueue(dsn, schema, "email.send", {"email-refused": _email(10)})
    with (
        FakeEmailProvider(api_key="re_test_another_key") as strict,
        closing(RecordingEmail(RESEND_KEY, strict.url, TIMEOUT)) as refused,
    ):
        _dispatch(dsn, schema, refused)

    rows = job_rows(dsn, schema)
    assert {k: r["status"] for k, r in rows.items()} == {
        **dict.fromkeys(good, "done"), "email-invalid": "failed", "email-refused": "failed"}
    assert stats.retried >= 3  # and the 429: a throttle, handed back uncounted
    assert "html" in rows["email-invalid"]["last_error"]
    assert "invalid_api_key" in rows["email-refused"]["last_error"]
    assert len(adapter.errors) >= 4 and len(refused.errors) == 1
    _assert_loggers_were_heard(caplog.records, "httpx", "httpcore", "outbox.dispatcher",
                               "effects.email")
    _assert_logs_name_the_troubled_jobs(dsn, schema, caplog.records)
    _assert_nothing_leaked(dsn, schema, caplog.records, capsys.readouterr().err,
                           [*adapter.errors, *refused.errors])


def _charge(n: int, payment_method: str = "pm_card_visa") -> dict[str, Any]:
    return {"amount": 1000 + n, "currency": "eur", "customer": f"cus_{n}",
            "payment_method": payment_method}


def test_charge(dsn: str, schema: str, caplog: pytest.LogCaptureFixture,
                capsys: pytest.CaptureFixture[str]) -> None:
    good = {f"charge-{n}": _charge(n) for n in range(4)}
    declined = _charge(8, "pm_card_chargeDeclined")
    _enqueue(dsn, schema, "payment.charge", {**good, "charge-declined": declined})
    with (
        FakeStripe(api_key=STRIPE_KEY) as fake,
        closing(RecordingCharge(STRIPE_KEY, fake.url, TIMEOUT)) as adapter,
    ):
        fake.fail_next(1, 500)
        fake.fail_next(1, 429, retry_after=0)
        fake.succeed_then_timeout(1)
        stats = _dispatch(dsn, schema, adapter)
        assert [fake.performed(key) for key in good] == [1] * 4
    _enqueue(dsn, schema, "payment.charge", {"charge-refused": _charge(10)})
    with (
        FakeStripe(api_key="sk_test_another_key") as strict,
        closing(RecordingCharge(STRIPE_KEY, strict.url, TIMEOUT)) as refused,
    ):
        _dispatch(dsn, schema, refused)

    rows = job_rows(dsn, schema)
    assert {k: r["status"] for k, r in rows.items()} == {
        **dict.fromkeys(good, "done"), "charge-declined": "failed", "charge-refused": "failed"}
    assert stats.retried >= 2  # and the 429: a throttle, handed back uncounted
    assert "card declined" in rows["charge-declined"]["last_error"]
    assert "API key refused" in rows["charge-refused"]["last_error"]
    assert len(adapter.errors) >= 4 and len(refused.errors) == 1
    stderr = capsys.readouterr().err
    assert "Request to Stripe api" in stderr  # stripe.log = "debug" was on
    assert logged_about(caplog.records, "Post details")  # and its DEBUG records captured
    _assert_loggers_were_heard(caplog.records, "httpx", "httpcore", "stripe",
                               "outbox.dispatcher", "effects.payments")
    _assert_logs_name_the_troubled_jobs(dsn, schema, caplog.records)
    _assert_nothing_leaked(dsn, schema, caplog.records, stderr,
                           [*adapter.errors, *refused.errors])


def _event(n: int) -> dict[str, Any]:
    return {"event": "order.shipped", "data": {"order": n, "customer": PII, "note": [PII] * 2}}


def test_webhook(dsn: str, schema: str, caplog: pytest.LogCaptureFixture,
                 capsys: pytest.CaptureFixture[str],
                 fake_webhook: FakeWebhookReceiver) -> None:
    good = {f"hook-{n}": _event(n) for n in range(4)}
    _enqueue(dsn, schema, "webhook.post", good)
    with (
        FakeWebhookReceiver(WEBHOOK_SECRET) as receiver,
        closing(RecordingWebhook(receiver.url, WEBHOOK_SECRET, TIMEOUT)) as adapter,
    ):
        receiver.fail_next(2, 503)
        receiver.fail_next(1, 429, retry_after=0)
        receiver.succeed_then_timeout(1)
        stats = _dispatch(dsn, schema, adapter)
        assert [receiver.performed(key) for key in good] == [1] * 4
    # fake_webhook expects another signing secret: our signature is refused (401).
    _enqueue(dsn, schema, "webhook.post", {"hook-refused": _event(10)})
    with closing(RecordingWebhook(fake_webhook.url, WEBHOOK_SECRET, TIMEOUT)) as refused:
        _dispatch(dsn, schema, refused)

    rows = job_rows(dsn, schema)
    assert {k: r["status"] for k, r in rows.items()} == {
        **dict.fromkeys(good, "done"), "hook-refused": "failed"}
    assert stats.retried >= 3  # and the 429: a throttle, handed back uncounted
    assert "HTTP 401" in rows["hook-refused"]["last_error"]
    assert len(adapter.errors) >= 4 and len(refused.errors) == 1
    _assert_loggers_were_heard(caplog.records, "httpx", "httpcore", "outbox.dispatcher",
                               "effects.webhook")
    _assert_logs_name_the_troubled_jobs(dsn, schema, caplog.records)
    _assert_nothing_leaked(dsn, schema, caplog.records, capsys.readouterr().err,
                           [*adapter.errors, *refused.errors])


def test_stripe_request_bodies_reach_only_stripes_own_debug_log(
    dsn: str, schema: str, caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Payload contents of a charge reach no log but stripe-python's own DEBUG records;
    with the ``stripe`` logger at INFO, as ``effects.payments`` advises, none at all."""
    payload = {**_charge(1), "description": f"gift for {PII}", "metadata": {"who": PII}}
    _enqueue(dsn, schema, "payment.charge", {"charge-debug": payload})
    with FakeStripe(api_key=STRIPE_KEY) as fake, closing(
        RecordingCharge(STRIPE_KEY, fake.url, TIMEOUT)
    ) as adapter:
        fake.fail_next(1, 500)
        _dispatch(dsn, schema, adapter)
        carriers = {(r.name, r.levelname) for r, text in log_texts(caplog.records) if PII in text}
        assert carriers <= {("stripe", "DEBUG")}, carriers

        caplog.clear()
        monkeypatch.setattr(stripe, "log", None)
        caplog.set_level(logging.INFO, logger="stripe")
        payload = {**payload, "amount": 2000}
        _enqueue(dsn, schema, "payment.charge", {"charge-info": payload})
        fake.fail_next(1, 500)
        _dispatch(dsn, schema, adapter)
    assert {k: r["status"] for k, r in job_rows(dsn, schema).items()} == {
        "charge-debug": "done", "charge-info": "done"}
    _assert_loggers_were_heard(caplog.records, "stripe", "httpx")
    _assert_nothing_leaked(dsn, schema, caplog.records, capsys.readouterr().err, adapter.errors)
