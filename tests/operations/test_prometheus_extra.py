"""``outbox-pg[prometheus]`` alone serves the database metrics: installed from this checkout
into a fresh virtual environment with no other extra, the collector reads the tables and
serves ``outbox_jobs`` and the oldest due age over HTTP, with neither Starlette nor
Jinja2 (the dashboard's extra) present."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

import outbox

ROOT = Path(__file__).resolve().parents[2]

SERVE = """
import importlib.util, sys, urllib.request
from prometheus_client import CollectorRegistry
from outbox.metrics import DatabaseCollector, serve_metrics

present = [m for m in ("starlette", "jinja2") if importlib.util.find_spec(m) is not None]
assert not present, f"the dashboard's extra is installed: {present}"
registry = CollectorRegistry()
registry.register(DatabaseCollector(sys.argv[1], sys.argv[2]))
server = serve_metrics(0, registry=registry)
port = server.server_address[1]
print(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode())
server.shutdown()
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("starlette", "jinja2"))
assert not loaded and "outbox.web" not in sys.modules, loaded
"""


@pytest.fixture(scope="module")
def python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with this checkout and the prometheus extra only."""
    venv = tmp_path_factory.mktemp("prometheus-extra") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    executable = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(executable), "install",
                    "--quiet", f"{ROOT}[prometheus]"], check=True, timeout=600)
    return executable


def test_the_prometheus_extra_alone_serves_the_database_metrics(
        python: Path, dsn: str, schema: str) -> None:
    with psycopg.connect(dsn) as conn:
        with outbox.transaction(conn, schema=schema) as tx:
            tx.enqueue("email.send", key="k1", payload={})
            tx.enqueue("email.send", key="k2", payload={})
        conn.execute(sql.SQL("UPDATE {}.jobs SET available_at = %s").format(
            sql.Identifier(schema)), (datetime.now(UTC) - timedelta(seconds=90),))
        conn.commit()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run([str(python), "-c", SERVE, dsn, schema], cwd=python.parent,
                          env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    body = done.stdout
    assert 'outbox_jobs{effect="email.send",status="pending"} 2.0' in body
    assert "outbox_database_up 1.0" in body
    [age] = [line for line in body.splitlines()
             if line.startswith('outbox_oldest_due_job_age_seconds{effect="email.send"}')]
    assert 90 <= float(age.split()[-1]) < 300
    # and the installed package is the one from this environment, not the checkout
    where = subprocess.run([str(python), "-c", "import outbox; print(outbox.__file__)"],
                           cwd=python.parent, env=env, capture_output=True, text=True,
                           check=True, timeout=60).stdout
    assert not Path(where.strip()).is_relative_to(ROOT)


def _imports(path: Path) -> set[str]:
    """The absolute module names ``path`` imports (relative ones resolved)."""
    import ast

    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            found |= {module, *(f"{module}.{alias.name}" for alias in node.names)}
    return found


def test_the_dashboard_and_the_metrics_module_do_not_import_each_other() -> None:
    metrics = _imports(ROOT / "outbox" / "metrics.py")
    assert not {m for m in metrics if m.startswith("outbox.web")}
    for path in (ROOT / "outbox" / "web").glob("*.py"):
        assert "outbox.metrics" not in _imports(path), path.name
    # The collector they share lives in the core and needs neither.
    shared = _imports(ROOT / "outbox" / "_database_metrics.py")
    assert not {m for m in shared if m.startswith(("outbox.web", "outbox.metrics"))}
