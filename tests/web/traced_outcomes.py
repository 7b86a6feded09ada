"""Run in a process of its own (a tracer provider is process-global): enqueue (once, a
repeat, a rolled-back block), dispatch attempts that end every way, one of them with its
outcome refused by the database; print the finished spans and the jobs as JSON lines."""

from __future__ import annotations

import json
import sys

import psycopg
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from psycopg import sql

import outbox


class Modes(outbox.Effect):
    name = "test.modes"

    def perform(self, job: outbox.Job) -> dict[str, bool]:
        mode = job.payload["mode"]
        if mode == "retry" and job.attempt == 1:
            raise outbox.Retry(after=3600)
        if mode == "boom" and job.attempt == 1:
            raise RuntimeError("SECRET-ERROR-TEXT")
        if mode == "fail":
            raise outbox.Permanent("SECRET-ERROR-TEXT")
        return {"ok": True}


def refuse_first_done(conn: psycopg.Connection[tuple[object, ...]], schema: str) -> None:
    ident = sql.Identifier(schema)
    conn.execute(sql.SQL(
        "CREATE FUNCTION {}.refuse_done() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        "IF NEW.status = 'done' AND OLD.attempts = 1 AND NEW.key = 'refused' "
        "THEN RAISE EXCEPTION 'outcome refused'; END IF; RETURN NEW; END $$").format(ident))
    conn.execute(sql.SQL("CREATE TRIGGER refuse_done BEFORE UPDATE ON {}.jobs FOR EACH ROW "
                         "EXECUTE FUNCTION {}.refuse_done()").format(ident, ident))


class RolledBack(Exception):
    pass


def main(dsn: str, schema: str) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    with psycopg.connect(dsn, autocommit=True) as conn:
        refuse_first_done(conn, schema)
        with outbox.transaction(conn, schema=schema) as tx:
            for mode in ("ok", "retry", "boom", "fail", "refused"):
                tx.enqueue("test.modes", key=mode, payload={"mode": mode})
        with outbox.transaction(conn, schema=schema) as tx:
            tx.enqueue("test.modes", key="ok", payload={"mode": "ok"})  # a repeat
        try:
            with outbox.transaction(conn, schema=schema) as tx:
                tx.enqueue("test.modes", key="rolled-back", payload={"mode": "ok"})
                raise RolledBack
        except RolledBack:
            pass
    # A short backoff: the refused job's lease expires and its rescue (an unknown outcome)
    # retries it after the backoff, in this run; ``boom`` retries too and then succeeds.
    outbox.Dispatcher(dsn, [Modes()], schema=schema, lease=1.0, rescue_interval=0.2,
                      backoff=outbox.Backoff(base=0.05, cap=0.1)).run_until_idle(timeout=60)
    with psycopg.connect(dsn) as conn:
        jobs = conn.execute(sql.SQL("SELECT id, key, status, attempts FROM {}.jobs").format(
            sql.Identifier(schema))).fetchall()
    for s in exporter.get_finished_spans():
        print(json.dumps({
            "name": s.name, "kind": s.kind.name, "attributes": dict(s.attributes or {}),
            "status": s.status.status_code.name, "description": s.status.description,
            "events": [{"name": e.name, **dict(e.attributes or {})} for e in s.events],
        }))
    print(json.dumps({"jobs": [list(row) for row in jobs]}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
