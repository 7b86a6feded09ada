"""Traces: a PRODUCER span per enqueue, a CONSUMER span per attempt linked to it through
the job's trace_context column, the settle event; nothing when no provider is set."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import psycopg
import pytest
from psycopg import sql

import outbox
from outbox import tracing


def _spans(dsn: str, schema: str, flavour: str = "threads") -> list[dict[str, Any]]:
    done = subprocess.run([sys.executable, "-m", "tests.web.traced_run", dsn, schema, flavour],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


@pytest.mark.parametrize("flavour", ["threads", "async"])
def test_enqueue_and_attempts_are_traced_and_linked(
        dsn: str, schema: str, flavour: str) -> None:
    spans = _spans(dsn, schema, flavour)
    by_name: dict[str, list[dict[str, Any]]] = {}
    for span in spans:
        by_name.setdefault(span["name"], []).append(span)
    [order] = by_name["place order"]
    sends = by_name["send test.outcome"]
    assert len(sends) == 3  # two enqueues and one enqueue_many
    assert all(s["kind"] == "PRODUCER" and s["parent"] == order["span"]
               and s["trace"] == order["trace"] for s in sends)
    assert sends[2]["attributes"]["messaging.batch.message_count"] == 1
    processes = by_name["process test.outcome"]
    assert len(processes) == 4  # three jobs, and the lost claim's attempt below
    linked = [p for p in processes if p["links"]]
    assert sorted(p["links"][0] for p in linked) == sorted(s["span"] for s in sends)
    for p in linked:
        assert p["kind"] == "CONSUMER" and p["parent"] is None
        assert p["trace"] != order["trace"]  # a trace of its own, linked
        assert p["attributes"]["messaging.system"] == "outbox"
        assert p["attributes"]["messaging.destination.name"] == "test.outcome"
        assert p["attributes"]["outbox.attempt"] == 1
    outcomes = sorted(p["attributes"]["outbox.outcome"] for p in processes)
    assert outcomes == ["done", "done", "failed", "lost"]
    calls = by_name["provider call"]
    assert {c["parent"] for c in calls} == {p["span"] for p in linked}
    settles = [event for p in processes for event in p["events"] if event["name"] == "settle"]
    assert len(settles) == 4
    rejected = {s["outbox.outcome"]: s["outbox.fence_rejected"] for s in settles}
    assert rejected == {"done": False, "failed": False, "lost": True}
    failed = [p for p in processes if p["attributes"]["outbox.outcome"] == "failed"]
    assert [p["status"] for p in failed] == ["ERROR"]
    text = json.dumps(sends + processes)
    assert "SECRET" not in text  # no key, payload or error text in outbox's spans


def test_the_trace_context_is_stored_beside_the_payload_not_in_it(
        dsn: str, schema: str) -> None:
    _spans(dsn, schema)
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(sql.SQL("SELECT payload, trace_context FROM {}.jobs").format(
            sql.Identifier(schema))).fetchall()
    assert len(rows) == 3
    for payload, context in rows:
        assert set(context) == {"traceparent"} and context["traceparent"].startswith("00-")
        assert "traceparent" not in json.dumps(payload)


def test_without_a_tracer_provider_nothing_is_traced_or_stored(dsn: str, schema: str) -> None:
    assert not tracing.enabled()
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue("test.outcome", key="k1", payload={})
    with psycopg.connect(dsn) as conn:
        row = conn.execute(sql.SQL("SELECT trace_context FROM {}.jobs").format(
            sql.Identifier(schema))).fetchone()
    assert row == (None,)
