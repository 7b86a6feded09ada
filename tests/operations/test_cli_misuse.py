"""Every misuse of the ``outbox`` command prints one line and exits non-zero: no traceback.

Run as real processes, as an operator would, so that nothing (logging set-up, a thread,
an exception escaping click) can add to what the terminal shows.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

APP = """
    import outbox

    class Noop(outbox.Effect):
        name = "noop"

        def perform(self, job):
            return None

    dispatcher = outbox.Dispatcher({dsn!r}, [Noop()], schema={schema!r})

    class NotADispatcher:
        pass

    def helper():
        return 42

    def needs_arguments(a, b):
        return outbox.Dispatcher({dsn!r}, [Noop()])

    def raises():
        raise RuntimeError("factory failed")

    def main() -> None:
        open("main-ran", "w").close()

    def make() -> outbox.Dispatcher:
        return dispatcher
"""


def _outbox(cwd: Path, *args: str, dsn: str | None = None) -> subprocess.CompletedProcess[str]:
    env_args = ["--dsn", dsn] if dsn else []
    return subprocess.run([sys.executable, "-m", "outbox.cli", *args, *env_args], cwd=cwd,
                          capture_output=True, text=True, timeout=60, check=False)


def _assert_one_line(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert result.returncode != 0, result
    assert "Traceback" not in result.stderr + result.stdout
    lines = [line for line in (result.stderr + result.stdout).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture
def app_dir(tmp_path: Path, dsn: str, schema: str) -> Path:
    (tmp_path / "shop_app.py").write_text(textwrap.dedent(APP.format(dsn=dsn, schema=schema)))
    (tmp_path / "broken_app.py").write_text("import outbox\nraise RuntimeError('bad config')\n")
    (tmp_path / "typo_app.py").write_text("def f(:\n")
    return tmp_path


@pytest.mark.parametrize(("target", "fragments"), [
    ("no_such_module_xyz:dispatcher", ("no_such_module_xyz",)),
    ("broken_app:dispatcher", ("broken_app", "RuntimeError", "bad config")),
    ("typo_app:dispatcher", ("typo_app", "SyntaxError")),
    ("shop_app:missing", ("shop_app", "missing")),
    ("shop_app:NotADispatcher", ("shop_app:NotADispatcher", "class", "Dispatcher")),
    ("shop_app:helper", ("shop_app:helper", "int", "Dispatcher")),
    ("shop_app:needs_arguments", ("shop_app:needs_arguments", "needs arguments")),
    ("shop_app:main", ("shop_app:main", "returning None", "Dispatcher")),
    ("shop_app:raises", ("shop_app:raises", "factory failed")),
    ("shop_app:outbox", ("shop_app:outbox", "module", "Dispatcher")),
])
def test_run_with_a_target_that_is_not_a_dispatcher(
    app_dir: Path, target: str, fragments: tuple[str, ...]
) -> None:
    _assert_one_line(_outbox(app_dir, "run", target), *fragments)
    assert not (app_dir / "main-ran").exists()  # a function that is no factory is not run


def test_run_against_an_unmigrated_schema(app_dir: Path, dsn: str) -> None:
    schema = f"never_{uuid.uuid4().hex[:8]}"
    (app_dir / "fresh_app.py").write_text(textwrap.dedent(f"""
        import outbox

        class Noop(outbox.Effect):
            name = "noop"

            def perform(self, job):
                return None

        dispatcher = outbox.Dispatcher({dsn!r}, [Noop()], schema={schema!r})
    """))
    _assert_one_line(_outbox(app_dir, "run", "fresh_app:dispatcher"), schema, "outbox migrate")


@pytest.mark.parametrize("command", ["status", "retry"])
def test_commands_against_an_unmigrated_schema(tmp_path: Path, dsn: str, command: str) -> None:
    extra = ["7"] if command == "retry" else []
    schema = f"never_{uuid.uuid4().hex[:8]}"
    result = _outbox(tmp_path, command, *extra, "--schema", schema, dsn=dsn)
    _assert_one_line(result, schema, "outbox migrate")


def test_retry_of_a_job_that_does_not_exist(tmp_path: Path, dsn: str, schema: str) -> None:
    result = _outbox(tmp_path, "retry", "424242", "--schema", schema, dsn=dsn)
    _assert_one_line(result, "no job 424242", schema)


@pytest.mark.parametrize("bad", ["host=db password=Sekr1t-99 oops",
                                 "postgresql://app:Sekr1t-99@[db/shop"])
def test_a_malformed_dsn_is_one_line_without_the_password(tmp_path: Path, bad: str) -> None:
    result = _outbox(tmp_path, "status", dsn=bad)
    _assert_one_line(result, "connection string is not valid")
    assert "Sekr1t-99" not in result.stderr + result.stdout


def test_a_command_whose_extra_is_not_installed_names_the_extra(
        tmp_path: Path, dsn: str, schema: str) -> None:
    # None in sys.modules is Python's own way to make an import fail as if the package
    # were absent: here uvicorn, which only the ``web`` extra installs.
    blocked = ("import sys; sys.modules['uvicorn'] = None; from outbox.cli import main; "
               "main()")
    result = subprocess.run(
        [sys.executable, "-c", blocked, "web", "--dsn", dsn, "--schema", schema],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    _assert_one_line(result, "pip install 'outbox-pg[web]'")
