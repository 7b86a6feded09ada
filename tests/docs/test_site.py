"""The docs site builds offline with warnings as errors, carries the generated reference,
loads nothing from another host, and every code block on its pages (and the README) is
either run (tests/test_readme.py), checked here, or marked illustrative with a reason."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import click
import pytest
import yaml

from outbox.cli import main

from ..test_readme import PAGES, ROOT

_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```",
                    re.S | re.M)
# Shown, never run: a terminal's output, a diagram, a file of another tool.
_SHOWN = {"text", "python", "sh", "yaml", "json", "sql", "toml", "ini", "dockerfile", "http",
          "javascript", "go"}
# A resource a page would load (not a link a reader may follow).
_LOADS = re.compile(r"""<(?:script|img|iframe|source)\b[^>]*\bsrc=["']?(?:https?:)?//"""
                    r"""|<link\b[^>]*\bhref=["']?(?:https?:)?//|@import\s+url\(["']?(?:https?:)?//""")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-f",
         str(ROOT / "mkdocs.yml"), "-d", str(out)],
        cwd=ROOT, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_the_site_has_its_sections(site: Path) -> None:
    for page in ("index.html", "tutorial/index.html", "tutorial/quick-start.html",
                 "how-to/integrations.html", "reference/outbox.html",
                 "explanation/guarantees.html", "search/search_index.json"):
        assert (site / page).is_file(), page


def test_the_reference_carries_the_docstrings(site: Path) -> None:
    import outbox

    first_line = (outbox.Dispatcher.__doc__ or "").strip().splitlines()[0]
    assert first_line in (site / "reference" / "outbox.html").read_text()
    index = json.loads((site / "search" / "search_index.json").read_text())
    assert any("reconcile" in doc["text"] for doc in index["docs"])


def test_every_command_is_in_the_cli_reference(site: Path) -> None:
    text = (site / "reference" / "cli.html").read_text()
    ctx = click.Context(main, info_name="outbox")
    for name in main.list_commands(ctx):
        assert f"outbox {name}" in text, name


def test_the_metrics_reference_lists_every_family(site: Path) -> None:
    text = (site / "reference" / "metrics.html").read_text()
    defined = set()
    for path in (ROOT / "outbox").glob("*metrics.py"):
        defined |= set(re.findall(r"MetricFamily\(\s*\"(outbox_[a-z_]+)\"", path.read_text()))
    assert len(defined) >= 10
    missing = [name for name in sorted(defined) if name not in text]
    assert not missing, missing


def test_the_site_loads_nothing_from_another_host(site: Path) -> None:
    loads = []
    for path in site.rglob("*"):
        if path.suffix in {".html", ".css"}:
            loads += [f"{path.relative_to(site)}: {m[0]}"
                      for m in _LOADS.finditer(path.read_text(errors="replace"))]
    assert not loads, loads


def _fences() -> list[tuple[str, str, str]]:
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in _FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append((f"{page.relative_to(ROOT)}:{line}", match["lang"].strip(),
                          match["body"]))
    return found


FENCES = _fences()


def test_every_code_block_names_its_language() -> None:
    unknown = [(where, lang) for where, lang, _ in FENCES if lang not in _SHOWN]
    assert not unknown, unknown


def _outbox_commands(body: str) -> list[list[str]]:
    commands = []
    for raw in body.replace("\\\n", " ").splitlines():
        line = raw.split(" #", 1)[0].strip()
        words = shlex.split(line) if line and not line.startswith("#") else []
        while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
            words = words[1:]  # VAR=value before the command
        if words[:1] == ["outbox"]:
            commands.append(words[1:])
    return commands


def test_every_outbox_command_shown_parses() -> None:
    """A shell block's ``outbox ...`` lines name real commands and options."""
    checked = 0
    for where, lang, body in FENCES:
        if lang != "sh":
            continue
        for args in _outbox_commands(body):
            if "$(" in " ".join(args) or not args:
                continue
            command, rest = args[0], args[1:]
            sub = main.get_command(click.Context(main, info_name="outbox"), command)
            assert sub is not None, f"{where}: no command {command!r}"
            options = {o for p in sub.params for o in getattr(p, "opts", [])} | {"--help"}
            unknown = [a.split("=")[0] for a in rest
                       if a.startswith("--") and a.split("=")[0] not in options]
            if isinstance(sub, click.Group):
                unknown = []  # options of a subcommand, checked by its own page
            assert not unknown, f"{where}: outbox {command}: unknown {unknown}"
            checked += 1
    assert checked >= 5


def test_every_yaml_and_json_block_parses() -> None:
    for where, lang, body in FENCES:
        if lang == "yaml":
            assert yaml.safe_load(body) is not None, where
        elif lang == "json":
            json.loads(body)
