"""What the secrecy tests share: the secrets, and where to look for them.

Looked at: every log record (message, arguments, exception text) of every logger at
DEBUG, including httpx, httpcore and stripe; what stripe-python prints to stderr with
``stripe.log = "debug"``; every column of every job and ledger row; every exception an
adapter raised, with its whole chain. Not looked at: what the fake providers stored,
which is the provider's side (the key is in the Authorization header there by design).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from effects.email import SendEmail
from effects.payments import ChargeCard
from effects.webhook import PostWebhook
from outbox import Job

__all__ = [
    "LOGGERS",
    "PII",
    "RESEND_KEY",
    "SECRETS",
    "STRIPE_KEY",
    "WEBHOOK_SECRET",
    "RecordingCharge",
    "RecordingEmail",
    "RecordingWebhook",
    "capture_everything",
    "exception_texts",
    "log_texts",
    "logged_about",
    "stored_texts",
]

STRIPE_KEY = "sk_test_SECRET_abc123"
RESEND_KEY = "re_test_SECRET_abc123"
WEBHOOK_SECRET = "whsec_SECRETabc123"
# The shared core also catches a key echoed in part (e.g. without its prefix).
SECRETS = (STRIPE_KEY, RESEND_KEY, WEBHOOK_SECRET, "SECRET_abc123", "SECRETabc123")
PII = "PAYLOAD_PII_MARKER"

# Set to DEBUG explicitly, in case a library pinned its own level.
LOGGERS = ("", "outbox", "effects", "effects.testing", "httpx", "httpcore", "stripe")


def capture_everything(caplog: pytest.LogCaptureFixture) -> None:
    """Capture every record of every logger, DEBUG and up."""
    for name in LOGGERS:
        caplog.set_level(logging.DEBUG, logger=name)


def log_texts(records: Iterable[logging.LogRecord]) -> Iterator[tuple[logging.LogRecord, str]]:
    """Each record with every text it carries: message, raw arguments, exception."""
    formatter = logging.Formatter()
    for record in records:
        yield record, record.getMessage()
        yield record, repr(record.args)
        if record.exc_info:
            yield record, formatter.formatException(record.exc_info)
        if record.stack_info:
            yield record, record.stack_info


def logged_about(records: Iterable[logging.LogRecord], *fragments: str) -> bool:
    """Whether one record's message holds every fragment."""
    return any(all(f in record.getMessage() for f in fragments) for record in records)


def exception_texts(errors: Iterable[BaseException]) -> Iterator[str]:
    """str, repr and args of each exception and of its whole cause/context chain."""
    for error in errors:
        seen: BaseException | None = error
        while seen is not None:
            yield str(seen)
            yield repr(seen)
            yield from (repr(arg) for arg in seen.args)
            seen = seen.__cause__ or seen.__context__


def _table_texts(conn: psycopg.Connection[Any], schema: str, table: str) -> list[str]:
    query = sql.SQL("SELECT row_to_json(t)::text FROM {}.{} t").format(
        sql.Identifier(schema), sql.Identifier(table)
    )
    return [row[0] for row in conn.execute(query)]


def stored_texts(dsn: str, schema: str) -> list[str]:
    """Every job row and every ledger row, all columns, as JSON text."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return _table_texts(conn, schema, "jobs") + _table_texts(conn, schema, "effect_results")


class RecordingEmail(SendEmail):
    """SendEmail that keeps every exception its perform raised."""

    def __init__(self, api_key: str, base_url: str, timeout: float) -> None:
        super().__init__(api_key, base_url=base_url, timeout=timeout)
        self.errors: list[BaseException] = []

    def perform(self, job: Job) -> dict[str, Any]:
        try:
            return super().perform(job)
        except Exception as exc:
            self.errors.append(exc)
            raise


class RecordingCharge(ChargeCard):
    """ChargeCard that keeps every exception its perform raised."""

    def __init__(self, api_key: str, base_url: str, timeout: float) -> None:
        super().__init__(api_key, base_url=base_url, timeout=timeout)
        self.errors: list[BaseException] = []

    def perform(self, job: Job) -> dict[str, Any]:
        try:
            return super().perform(job)
        except Exception as exc:
            self.errors.append(exc)
            raise


class RecordingWebhook(PostWebhook):
    """PostWebhook that keeps every exception its perform raised."""

    def __init__(self, url: str, secret: str, timeout: float) -> None:
        super().__init__(url, secret, timeout=timeout)
        self.errors: list[BaseException] = []

    def perform(self, job: Job) -> dict[str, Any]:
        try:
            return super().perform(job)
        except Exception as exc:
            self.errors.append(exc)
            raise
