"""Run in a process of its own (a tracer provider is process-global): enqueue inside an
application span, dispatch, and print the finished spans as JSON lines."""

from __future__ import annotations

import asyncio
import json
import sys

import psycopg
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import outbox
from outbox import tracing


class Outcomes(outbox.Effect):
    name = "test.outcome"

    def perform(self, job: outbox.Job) -> None:
        with trace.get_tracer("test").start_as_current_span("provider call"):
            if job.payload["outcome"] == "failed":
                raise outbox.Permanent("SECRET-ERROR-TEXT")


def main(dsn: str, schema: str, flavour: str) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    with psycopg.connect(dsn) as conn, trace.get_tracer("app").start_as_current_span(
            "place order"), outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue("test.outcome", key="SECRET-KEY-1", payload={"outcome": "done"})
        tx.enqueue("test.outcome", key="SECRET-KEY-2", payload={"outcome": "failed"})
        tx.enqueue_many([outbox.NewJob("test.outcome", "SECRET-KEY-3", {"outcome": "done"})])
    if flavour == "async":
        asyncio.run(outbox.AsyncDispatcher(dsn, [Outcomes()], schema=schema)
                    .run_until_idle(timeout=60))
    else:
        outbox.Dispatcher(dsn, [Outcomes()], schema=schema).run_until_idle(timeout=60)
    # The settle step of a claim that was lost, as the recorder reports it.
    span = tracing.attempt_span(0, "test.outcome", 2, None)
    tracing.settle(span, "test.outcome", "lost")
    for s in exporter.get_finished_spans():
        print(json.dumps({
            "name": s.name, "kind": s.kind.name,
            "trace": format(s.context.trace_id, "032x"), "span": format(s.context.span_id, "016x"),
            "parent": format(s.parent.span_id, "016x") if s.parent else None,
            "links": [format(link.context.span_id, "016x") for link in s.links],
            "attributes": dict(s.attributes or {}), "status": s.status.status_code.name,
            "events": [{"name": e.name, **dict(e.attributes or {})} for e in s.events],
        }))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
