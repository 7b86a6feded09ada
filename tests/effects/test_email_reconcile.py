"""``SendEmail.reconcile`` against the fake Resend: found where Resend's API proves it,
None where it cannot (never NotPerformed)."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta

import httpx
import pytest

import outbox
from effects import SendEmail
from effects.testing import FakeEmailProvider

from ._support import RESEND_KEY, email_payload, make_job


def _job(key: str, **changes: object) -> outbox.Job:
    job = make_job("email.send", key, email_payload(**changes))
    return dataclasses.replace(job, first_attempted_at=datetime.now(UTC) - timedelta(seconds=5))


def test_an_email_sent_whose_answer_was_lost_is_found(
    resend: FakeEmailProvider, send_email: SendEmail,
) -> None:
    resend.succeed_then_drop()
    with pytest.raises(outbox.UnknownOutcome):
        send_email.perform(_job("email-order-1"))
    send_email.perform(_job("email-order-2", subject="Another order"))
    [lost, _] = resend.sent_emails
    assert send_email.reconcile(_job("email-order-1")) == outbox.Performed({"id": lost.id})


def test_what_resend_cannot_prove_stays_unknown(
    resend: FakeEmailProvider, send_email: SendEmail,
) -> None:
    send_email.perform(_job("email-order-1"))
    assert send_email.reconcile(_job("email-order-9", subject="Never sent")) is None
    # Same envelope, other body: not this job's email.
    assert send_email.reconcile(_job("email-order-3", text="Other words")) is None
    # Sent before the job was first attempted: not this job's email either.
    old = dataclasses.replace(_job("email-order-4"),
                              first_attempted_at=datetime.now(UTC) + timedelta(hours=1))
    assert send_email.reconcile(old) is None


def test_an_unreachable_resend_raises(refused_url: str) -> None:
    with SendEmail(RESEND_KEY, base_url=refused_url, timeout=1.0) as adapter, \
            pytest.raises(httpx.HTTPError):
        adapter.reconcile(_job("email-order-1"))
