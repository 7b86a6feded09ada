"""Bad input reaching the dispatcher: every job ends in a state that says what was wrong,
none is dropped, none retried forever, and nothing is performed twice because an outcome
could not be written down.
"""

from __future__ import annotations

import math
import time
from datetime import datetime, timedelta
from typing import Any

import pytest

from effects.email import SendEmail
from effects.testing import FakeEmailProvider
from outbox import Dispatcher, Job, Permanent, Retry, UnknownOutcome
from outbox.testing import jobs as job_rows
from outbox.testing import ledger as ledger_rows

from ._support import Scripted, enqueue

# A stored error is cut to 2,000 characters, plus room for the suffix the dispatcher
# appends, e.g. " (attempt 1 of 1)".
ERROR_BOUND = 2000 + 64


def _dispatch(dsn: str, schema: str, effect: Scripted, **options: Any) -> None:
    """Run a dispatcher of ``effect`` until idle, with a short lease so that an outcome
    that could not be recorded shows up (rescued after its lease) within the test."""
    options.setdefault("lease", 1.0)
    Dispatcher(dsn, [effect], schema=schema, **options).run_until_idle(timeout=60)


def test_payload_failing_the_effect_model_fails_at_once_naming_the_fields(
    dsn: str, schema: str, fake_email: FakeEmailProvider
) -> None:
    missing = {"from": "shop@example.com", "to": "ann@example.com", "text": "hello"}
    wrong = {"from": "shop@example.com", "to": [], "subject": "s", "text": "t", "colour": "red"}
    enqueue(dsn, schema, "email-missing-subject", missing, effect="email.send")
    enqueue(dsn, schema, "email-wrong-fields", wrong, effect="email.send")
    with SendEmail(api_key="re_test_key", base_url=fake_email.url) as adapter:
        stats = Dispatcher(dsn, [adapter], schema=schema).run_until_idle(timeout=60)
    rows = job_rows(dsn, schema)
    assert {key: (row["status"], row["attempts"]) for key, row in rows.items()} == {
        "email-missing-subject": ("failed", 1),
        "email-wrong-fields": ("failed", 1),
    }
    first = rows["email-missing-subject"]["last_error"]
    assert "subject" in first and "Field required" in first, first
    second = rows["email-wrong-fields"]["last_error"]
    assert "to" in second and "colour" in second, second
    assert "ann@example.com" not in first  # names fields, not their values
    assert fake_email.total_requests == 0
    assert (stats.failed, stats.retried, stats.done) == (2, 0, 0)
    assert ledger_rows(dsn, schema) == {}


def test_unknown_effect_stays_pending_and_unclaimed(dsn: str, schema: str) -> None:
    enqueue(dsn, schema, "nobody-handles-this", {"n": 1}, effect="nobody.handles")
    enqueue(dsn, schema, "handled", {"n": 2})
    effect = Scripted(lambda job: {"ok": True})
    started = time.monotonic()
    stats = Dispatcher(dsn, [effect], schema=schema).run_until_idle(timeout=60)
    assert time.monotonic() - started < 30, "run_until_idle waited for a job it cannot claim"
    assert stats.claimed == 1
    unknown = job_rows(dsn, schema)["nobody-handles-this"]
    assert (unknown["status"], unknown["attempts"], unknown["claim_version"]) == ("pending", 0, 0)
    assert (unknown["claimed_by"], unknown["lease_until"], unknown["last_error"]) == (None,) * 3
    assert dict(effect.calls) == {"handled": 1}


class _Opaque:
    pass


@pytest.mark.parametrize(
    "result",
    [
        pytest.param({"tags": {"a"}}, id="set"),
        pytest.param({"at": datetime(2026, 1, 1)}, id="datetime"),
        pytest.param(_Opaque(), id="object"),
        pytest.param({"amount": math.nan}, id="nan"),
        pytest.param({"note": "a\x00b"}, id="nul"),
        pytest.param({"note": "half \ud800 pair"}, id="lone-surrogate"),
    ],
)
def test_unrecordable_result_still_marks_the_job_done(
    dsn: str, schema: str, result: object
) -> None:
    """The effect happened: the job is done (not performed again), and the ledger says
    the result could not be recorded."""
    enqueue(dsn, schema, "odd-result", {"n": 1}, max_attempts=3)
    effect = Scripted(lambda job: result)
    _dispatch(dsn, schema, effect)
    job = job_rows(dsn, schema)["odd-result"]
    assert (job["status"], job["attempts"]) == ("done", 1), job["last_error"]
    assert effect.calls["odd-result"] == 1
    recorded = ledger_rows(dsn, schema)["odd-result"]["result"]
    assert isinstance(recorded, dict) and "unrecorded_result" in recorded, recorded


def test_storable_result_that_only_looks_like_an_escape_is_recorded(
    dsn: str, schema: str
) -> None:
    result = {"pattern": "\\u0000", "note": "literal backslash, not a NUL"}
    enqueue(dsn, schema, "escape-result", {"n": 1})
    _dispatch(dsn, schema, Scripted(lambda job: result))
    assert ledger_rows(dsn, schema)["escape-result"]["result"] == result


def _raise(error: BaseException) -> Any:
    def behaviour(job: Job) -> Any:
        raise error

    return behaviour


@pytest.mark.parametrize(
    ("error", "status", "start"),
    [
        pytest.param(RuntimeError("x" * 5_000_000), "failed", "RuntimeError: xxx", id="runtime"),
        pytest.param(Permanent("p" * 5_000_000), "failed", "Permanent: ppp", id="permanent"),
        pytest.param(Retry("r" * 5_000_000), "failed", "Retry: rrr", id="retry"),
        pytest.param(UnknownOutcome("u" * 5_000_000), "reconcile", "UnknownOutcome: uuu",
                     id="unknown"),
    ],
)
def test_huge_error_message_is_bounded(
    dsn: str, schema: str, error: BaseException, status: str, start: str
) -> None:
    enqueue(dsn, schema, "huge-error", {"n": 1}, max_attempts=1)
    _dispatch(dsn, schema, Scripted(_raise(error)))
    job = job_rows(dsn, schema)["huge-error"]
    assert (job["status"], job["attempts"]) == (status, 1)
    assert job["last_error"].startswith(start)
    assert len(job["last_error"]) <= ERROR_BOUND


@pytest.mark.parametrize(
    "error",
    [
        pytest.param(Permanent("provider said \x00 (binary)"), id="nul-permanent"),
        pytest.param(RuntimeError("decode failed at \x00"), id="nul-exception"),
        pytest.param(Permanent("half \ud800 pair"), id="lone-surrogate-permanent"),
        pytest.param(ValueError("bad byte \udcff"), id="lone-surrogate-exception"),
    ],
)
def test_error_text_the_database_cannot_hold_is_recorded_anyway(
    dsn: str, schema: str, error: BaseException
) -> None:
    """An error message with a NUL or a lone surrogate must still be recorded: if the
    settle statement is refused, the real reason is lost and every attempt costs a lease."""
    enqueue(dsn, schema, "odd-error", {"n": 1}, max_attempts=1)
    effect = Scripted(_raise(error))
    _dispatch(dsn, schema, effect)
    job = job_rows(dsn, schema)["odd-error"]
    assert (job["status"], job["attempts"]) == ("failed", 1), job["last_error"]
    assert job["last_error"].startswith(type(error).__name__), job["last_error"]
    assert effect.calls["odd-error"] == 1


@pytest.mark.parametrize(
    "error",
    [
        pytest.param(Retry("slow down", after=1e20), id="retry-after-1e20"),
        pytest.param(Retry("slow down", after=math.inf), id="retry-after-inf"),
        pytest.param(UnknownOutcome("timeout", after=1e20), id="unknown-after-1e20"),
    ],
)
def test_absurd_retry_delay_still_settles(dsn: str, schema: str, error: BaseException) -> None:
    """A Retry-After far beyond any calendar (e.g. a provider's header of 10^20 seconds)
    must still be written as a retry, not make the settle statement fail."""
    enqueue(dsn, schema, "far-retry", {"n": 1}, max_attempts=3)
    effect = Scripted(_raise(error))
    _dispatch(dsn, schema, effect)
    job = job_rows(dsn, schema)["far-retry"]
    assert (job["status"], job["attempts"]) == ("pending", 1), job["last_error"]
    assert job["available_at"] > datetime.now(job["available_at"].tzinfo) + timedelta(days=1)
    assert effect.calls["far-retry"] == 1


def test_retry_refuses_a_delay_that_is_not_a_number() -> None:
    with pytest.raises(ValueError, match="after"):
        Retry("x", after=math.nan)
