"""Spans follow the OpenTelemetry messaging conventions, checked with the SDK's in-memory
exporter: ``error.type`` and an error status on every attempt whose ``perform`` raised
(a retry too, an unexpected exception too), the job id as ``messaging.message.id`` on
the producer span, a repeat and a rolled-back enqueue marked, and every attempt's span
ended, even when the database refused to record its outcome."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

Span = dict[str, Any]


def run(dsn: str, schema: str) -> tuple[list[Span], dict[str, tuple[int, str, int]]]:
    done = subprocess.run([sys.executable, "-m", "tests.web.traced_outcomes", dsn, schema],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    *spans, last = lines
    jobs = {key: (job_id, status, attempts) for job_id, key, status, attempts in last["jobs"]}
    assert "SECRET" not in done.stdout  # no key, payload or error text in outbox's spans
    return spans, jobs


def test_spans_follow_the_messaging_conventions(dsn: str, schema: str) -> None:
    spans, jobs = run(dsn, schema)
    assert "rolled-back" not in jobs
    assert jobs["refused"] == (jobs["refused"][0], "done", 2)

    sends = [s for s in spans if s["kind"] == "PRODUCER"]
    by_id: dict[str, list[Span]] = {}
    for s in sends:
        by_id.setdefault(s["attributes"].get("messaging.message.id", "none"), []).append(s)
    for key in ("retry", "boom", "fail", "refused"):
        [send] = by_id[str(jobs[key][0])]
        assert send["attributes"]["outbox.repeat"] is False and send["status"] == "UNSET"
    first, repeat = by_id[str(jobs["ok"][0])]
    assert first["attributes"]["outbox.repeat"] is False
    assert repeat["attributes"]["outbox.repeat"] is True
    [rolled_back] = [s for s in sends if s["attributes"].get("outbox.rolled_back")]
    assert rolled_back["status"] == "ERROR" and rolled_back["description"] is None
    assert rolled_back["attributes"]["error.type"] == "__main__.RolledBack"

    processes = [s for s in spans if s["kind"] == "CONSUMER"]
    # Every attempt the dispatcher made has an ended span: as many as attempts counted.
    assert len(processes) == sum(attempts for _, _, attempts in jobs.values())
    names = {str(job_id): key for key, (job_id, _, _) in jobs.items()}
    attempts: dict[tuple[str, int], Span] = {
        (names[p["attributes"]["messaging.message.id"]], p["attributes"]["outbox.attempt"]): p
        for p in processes}

    def check(key: str, attempt: int, outcome: str, error_type: str | None) -> None:
        span = attempts[(key, attempt)]
        attributes = span["attributes"]
        assert attributes["outbox.outcome"] == outcome, (key, attempt)
        assert attributes.get("error.type") == error_type, (key, attempt)
        assert span["status"] == ("UNSET" if error_type is None else "ERROR"), (key, attempt)
        assert span["description"] is None

    check("ok", 1, "done", None)
    check("retry", 1, "retry", "outbox.errors.Retry")
    check("boom", 1, "retry", "RuntimeError")  # an unexpected exception: a retry
    check("fail", 1, "failed", "outbox.errors.Permanent")
    check("refused", 1, "lost", "psycopg.errors.RaiseException")
    assert attempts[("refused", 1)]["attributes"]["outbox.unrecorded"] is True
    assert attempts[("refused", 1)]["attributes"]["outbox.fence_rejected"] is False
    check("refused", 2, "done", None)
