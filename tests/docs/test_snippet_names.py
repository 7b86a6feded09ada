"""Every ```python block of the README and of the docs site is self-contained: each name
it uses is imported or defined in the block itself, except the few a page may assume
(``ASSUMED``). A reader copies one block into a file and runs it; a block that relies on
an ``import os`` three blocks earlier fails for them.

The check is pyflakes' undefined-name rules as ruff implements them (F821, F822), run once
over every block; a failure names the page and the line in it, and says how to fix it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ..test_readme import ROOT, SNIPPETS, Snippet

# The names a page may use without defining them: a connection string. Keep this short.
ASSUMED = ("dsn",)


def _ruff() -> list[str]:
    return [sys.executable, "-m", "ruff"]


def undefined_names(snippets: list[Snippet], workdir: Path) -> list[str]:
    """``page:line: message`` for each name a block uses without importing or defining
    it (the line is the page's own, not the block's)."""
    files: dict[str, Snippet] = {}
    for number, snippet in enumerate(snippets):
        path = workdir / f"block_{number:04d}.py"
        path.write_text(snippet.code)
        files[path.name] = snippet
    done = subprocess.run(
        [*_ruff(), "check", "--isolated", "--no-cache", "--select", "F821,F822",
         "--output-format", "json", "--config", f"builtins = {list(ASSUMED)!r}", str(workdir)],
        capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode in (0, 1), done.stderr
    found: list[tuple[str, int, str]] = []
    for item in json.loads(done.stdout):
        snippet = files[Path(item["filename"]).name]
        # The block's first line is the line after its fence.
        line = snippet.line + item["location"]["row"]
        found.append((str(snippet.page.relative_to(ROOT)), line, item["message"]))
    return [f"{page}:{line}: {message}" for page, line, message in sorted(found)]


def test_the_check_finds_an_undefined_name(tmp_path: Path) -> None:
    """The check itself: a block using ``os`` without importing it is reported at the
    page's line; ``dsn`` is allowed; a block that imports what it uses passes."""
    page = ROOT / "docs" / "index.md"
    bad = Snippet(page, 10, "import psycopg\nconn = psycopg.connect(dsn)\n"
                            "print(os.environ['X'])\n", None)
    good = Snippet(page, 20, "import os\nprint(os.environ.get('X'), dsn)\n", None)
    assert undefined_names([bad, good], tmp_path) == [
        "docs/index.md:13: Undefined name `os`"]


def test_every_python_block_defines_or_imports_the_names_it_uses(tmp_path: Path) -> None:
    found = undefined_names(SNIPPETS, tmp_path)
    assert len(SNIPPETS) >= 15
    assert not found, (
        f"{len(found)} name(s) used in a ```python block of the README or docs/ without "
        f"being imported or defined in that block (a page may assume only "
        f"{', '.join(ASSUMED)}). Add the import or definition to the block itself:\n  "
        + "\n  ".join(found))
