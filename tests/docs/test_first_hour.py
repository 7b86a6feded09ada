"""What a newcomer meets in their first hour with the CLI: a wrong port at ``outbox run``
ends in one line naming where and the option (after one warning, not one a second), a
connection string that does not parse says why (and never quotes its password), and the
providers' SDKs are quiet at INFO."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from outbox.cli import main

from .support import hearing_ctrl_c

OUTBOX = str(Path(sys.executable).parent / "outbox")
APP = """\
import os
import signal

import outbox
from effects.email import SendEmail

dispatcher = outbox.Dispatcher(os.environ["OUTBOX_DATABASE_URL"],
                               [SendEmail(api_key="re_first_hour")])
"""


def _refused_port() -> int:
    """A port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_outbox_run_gives_up_on_a_refused_port_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "app.py").write_text(APP)
    port = _refused_port()
    env = {**os.environ, "PYTHONPATH": str(tmp_path),
           "OUTBOX_DATABASE_URL": f"postgresql://postgres@127.0.0.1:{port}/postgres"}
    done = subprocess.run([OUTBOX, "run", "app:dispatcher", "--wait-for-database", "2"],
                          cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60, check=False)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1, done.stderr
    where = f"host 127.0.0.1 port {port}"
    warnings = [line for line in lines if "WARNING" in line]
    assert len(warnings) == 1, lines  # said once, not at every attempt
    assert f"cannot reach the database at {where}" in warnings[0]
    assert "retrying for up to 2s" in warnings[0]
    assert lines[-1].startswith(f"Error: cannot reach the database at {where}"), lines
    assert "--wait-for-database" in lines[-1]
    assert not any(line.startswith("outbox run:") for line in lines)  # never started


def test_a_connection_string_that_does_not_parse_says_why() -> None:
    result = CliRunner().invoke(main, ["status", "--dsn", "host=db password=hunter two"])
    assert result.exit_code == 1
    message = result.output.strip()
    assert message == ('Error: cannot connect: the connection string is not valid: '
                       'missing "=" after "…" in connection info string'), message
    assert "two" not in message and "hunter" not in message


def test_the_provider_sdks_are_quiet_at_info() -> None:
    loggers = [logging.getLogger(name) for name in ("httpx", "httpcore", "stripe")]
    before = [logger.level for logger in loggers]
    try:
        result = CliRunner().invoke(main, ["--log-level", "INFO", "status", "--help"])
        assert result.exit_code == 0, result.output
        assert [logger.level for logger in loggers] == [logging.WARNING] * 3
        CliRunner().invoke(main, ["--log-level", "DEBUG", "status", "--help"])
        assert logging.getLogger("stripe").level == logging.WARNING  # DEBUG leaves them
    finally:
        for logger, level in zip(loggers, before, strict=True):
            logger.setLevel(level)


def test_the_demo_lists_each_order_once() -> None:
    """An order both declined and with its answer lost was listed twice."""
    from rich.console import Console

    from examples.shop.demo import Chain, _show_chains

    chains = [Chain(1, "charged", "pi_1", [("payment-order-1", "done", None)]),
              Chain(5, "payment_failed", None, [("payment-order-5", "failed", None)]),
              Chain(6, "charged", "pi_6", [("payment-order-6", "done", None)])]
    console = Console(record=True, width=200)
    _show_chains(console, chains, lost={"payment-order-5", "payment-order-6"})
    rows = [line for line in console.export_text().splitlines() if "payment-order-" in line]
    assert [row.split()[1] for row in rows] == ["1", "5", "6"], rows


def test_ctrl_c_while_waiting_for_the_database_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "app.py").write_text(APP)
    port = _refused_port()
    env = {**os.environ, "PYTHONPATH": str(tmp_path),
           "OUTBOX_DATABASE_URL": f"postgresql://postgres@127.0.0.1:{port}/postgres"}
    with subprocess.Popen(hearing_ctrl_c([OUTBOX, "run", "app:dispatcher",
                                          "--wait-for-database", "0"]),
                          cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True) as run:
        assert run.stderr is not None
        warning = run.stderr.readline()  # said once it is waiting: it is in the loop
        assert "retrying until it answers" in warning, warning
        run.send_signal(signal.SIGINT)
        rest = run.stderr.read()
        assert run.wait(30) == 1
    assert rest.strip().splitlines() == [
        f"Error: stopped while waiting for the database at host 127.0.0.1 port {port}: "
        "Ctrl-C"], rest
    assert "Traceback" not in rest
