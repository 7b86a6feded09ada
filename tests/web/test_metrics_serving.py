"""Per-process metrics over HTTP: loopback by default, and from ``outbox run``."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import psycopg
from prometheus_client import CollectorRegistry

import outbox
from outbox.metrics import PrometheusObserver, serve_metrics


def test_serve_metrics_binds_loopback_by_default() -> None:
    registry = CollectorRegistry()
    PrometheusObserver(registry).attempt_finished("e", "done", 0.01)
    server = serve_metrics(0, registry=registry)
    try:
        host, port = server.server_address[:2]
        assert host == "127.0.0.1"
        body = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert 'outbox_job_attempts_total{effect="e",outcome="done"} 1.0' in body
    finally:
        server.shutdown()
        server.server_close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape_until(url: str, wanted: str, process: subprocess.Popen[str]) -> str:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[1]
        try:
            body = httpx.get(url, timeout=5).text
        except httpx.TransportError:
            body = ""  # not listening yet
        if wanted in body:
            return body
        time.sleep(0.05)  # polling an HTTP endpoint: there is no event to wait on
    raise AssertionError(f"{wanted!r} never appeared at {url}")


def test_outbox_run_serves_the_dispatchers_metrics(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue("test.noop", key="a", payload={})
        tx.enqueue("test.noop", key="b", payload={})
    port = _free_port()
    env = {**os.environ, "OUTBOX_TEST_TARGET_DSN": dsn, "OUTBOX_TEST_TARGET_SCHEMA": schema}
    process = subprocess.Popen(
        [sys.executable, "-m", "outbox.cli", "run", "tests.web.metrics_target:dispatcher",
         "--metrics-port", str(port)], env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        body = _scrape_until(f"http://127.0.0.1:{port}/metrics",
                             'outbox_job_attempts_total{effect="test.noop",outcome="done"} 2.0',
                             process)
        assert 'outbox_job_queue_wait_seconds_count{effect="test.noop"} 2.0' in body
    finally:
        process.send_signal(signal.SIGTERM)
        _out, err = process.communicate(timeout=30)
    assert process.returncode == 0, err
