"""The core stays free of the observability extras: importing outbox (and enqueueing)
loads none of prometheus-client, Starlette, Jinja2 or OpenTelemetry."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys, psycopg, outbox
with psycopg.connect(sys.argv[1]) as conn, outbox.transaction(conn, schema=sys.argv[2]) as tx:
    tx.enqueue("e", key="k", payload={})
class Noop(outbox.Effect):
    name = "e"
    def perform(self, job):
        return None
outbox.Dispatcher(sys.argv[1], [Noop()], schema=sys.argv[2]).run_until_idle(timeout=30)
extras = ("prometheus_client", "starlette", "jinja2", "opentelemetry", "uvicorn")
print(sorted({m.split(".")[0] for m in sys.modules if m.startswith(extras)}))
"""


def test_the_core_imports_no_observability_extra(dsn: str, schema: str) -> None:
    done = subprocess.run([sys.executable, "-c", CHECK, dsn, schema], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
