"""``outbox run`` as a newcomer meets it: ``--dsn``, one start line saying where and
what, failure lines with their reason, and no line per HTTP request."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psycopg
from psycopg.conninfo import conninfo_to_dict

import outbox
from effects.testing import FakeEmailProvider
from outbox.testing import jobs

from .helpers import wait_until

MODULE = """
    import os

    import outbox
    from effects.email import SendEmail

    dispatcher = outbox.Dispatcher(
        os.environ["OUTBOX_DATABASE_URL"],
        [SendEmail(api_key="re_test_key", base_url=os.environ["EMAIL_URL"])],
        schema=os.environ["SCHEMA"], concurrency=4)
"""


def test_run_takes_dsn_says_one_start_line_and_failures_with_reasons(
    dsn: str, schema: str, tmp_path: Path, fake_email: FakeEmailProvider
) -> None:
    (tmp_path / "mailer.py").write_text(textwrap.dedent(MODULE))
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue("email.send", key="good", payload={
            "from": "shop@example.com", "to": "ada@example.com", "subject": "Hi",
            "text": "Thank you!"})
        tx.enqueue("email.send", key="bad", payload={"order": 102})
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "EMAIL_URL": fake_email.url,
           "SCHEMA": schema}
    env.pop("OUTBOX_DATABASE_URL", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "outbox.cli", "run", "mailer:dispatcher", "--dsn", dsn],
        cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: {j["status"] for j in jobs(dsn, schema).values()} == {"done",
                                                                                 "failed"},
                   what="both jobs settled")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    lines = err.strip().splitlines()
    params = conninfo_to_dict(dsn)
    assert lines[0].startswith("outbox run: Dispatcher ")
    assert (f" on {params.get('host')}:{params.get('port') or 5432}/" in lines[0]), lines[0]
    assert (f"schema {schema!r}, effects email.send, concurrency 4, woken by LISTEN"
            in lines[0]), lines[0]
    assert sum(line.startswith("outbox run:") for line in lines) == 1
    [failed] = [line for line in lines if "(key bad)" in line]
    assert "-> failed: Permanent: payload invalid for effect 'email.send'" in failed, failed
    assert not [line for line in lines if "HTTP Request" in line], err
    assert json.loads(lines[-1])["done"] == 1
