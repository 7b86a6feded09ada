"""``outbox run --target``: the application's dispatcher, its effects and options,
serving several outboxes from one process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from click.testing import CliRunner

from outbox import Target
from outbox.cli import main

from .support import Databases, enqueue, statuses

APP = '''
import os

import outbox


class Noop(outbox.Effect):
    name = "test.recorded"

    def perform(self, job):
        return None


dispatcher = outbox.Dispatcher(os.environ["OUTBOX_DATABASE_URL"], [Noop()], poll_interval=0.2)
'''


def test_outbox_run_serves_each_target_given(dsn: str, databases: Databases,
                                             tmp_path: Path) -> None:
    shared = databases.make("shop_a", "shop_b")
    targets = [Target(shared, "shop_a"), Target(shared, "shop_b")]
    for target in targets:
        enqueue(target, 40)
    (tmp_path / "fleetapp.py").write_text(APP)
    command = [sys.executable, "-c", "from outbox.cli import main; main()", "run",
               "fleetapp:dispatcher", "--dsn", shared,
               "--target", f"{shared}#shop_a", "--target", f"{shared}#shop_b",
               "--max-connections", "8"]
    process = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(tmp_path)})
    try:
        deadline = time.monotonic() + 60
        while any(statuses(t) != Counter(done=40) for t in targets):
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, [statuses(t) for t in targets]
            time.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, err
    assert "serving several targets" in err
    assert '"done": 80' in err  # the counters summed over the targets


def test_outbox_run_refuses_both_target_options() -> None:
    result = CliRunner().invoke(main, ["run", "nowhere:d", "--target", "dbname=x",
                                       "--targets", "m:f"])
    assert result.exit_code != 0 and "not both" in result.output


def test_outbox_status_reports_each_target(dsn: str, databases: Databases) -> None:
    import json

    shared = databases.make("served")
    enqueue(Target(shared, "served"), 3)
    result = CliRunner().invoke(main, ["status", "--target", f"{shared}#served",
                                       "--target", f"{shared}#missing", "--json"])
    assert result.exit_code == 0, result.output
    served, missing = json.loads(result.output)
    assert served["up"] and served["jobs"]["pending"] == 3 and served["due_backlog"] == 3
    assert not missing["up"] and "missing" in missing["target"]
    assert "migrate" in missing["error"] or "schema" in missing["error"], missing
    text = CliRunner().invoke(main, ["status", "--target", f"{shared}#missing"]).output
    assert "#missing: DOWN" in text
