"""An integration imported without its extra names the extra to install, at import."""

from __future__ import annotations

import subprocess
import sys

import pytest

HIDE_AND_IMPORT = """
import sys
sys.modules[sys.argv[1]] = None  # as if the extra were not installed
try:
    __import__(sys.argv[2])
except ModuleNotFoundError as exc:
    print(f"{exc.name}|{exc}")
"""


@pytest.mark.parametrize(("hidden", "module", "extra"), [
    ("prometheus_client", "outbox.metrics", "prometheus"),
    ("starlette", "outbox.web", "web"),
    ("sqlalchemy", "outbox.contrib.sqlalchemy", "sqlalchemy"),
    ("django", "outbox.contrib.django", "django"),
    ("nats", "effects.nats", "nats"),
])
def test_the_missing_extra_is_named(hidden: str, module: str, extra: str) -> None:
    done = subprocess.run([sys.executable, "-c", HIDE_AND_IMPORT, hidden, module],
                          capture_output=True, text=True, timeout=60, check=True)
    name, _, message = done.stdout.strip().partition("|")
    assert name.partition(".")[0] == hidden
    assert message == (f"{module} needs {hidden}, which is not installed: "
                       f"pip install 'outbox-pg[{extra}]'")
