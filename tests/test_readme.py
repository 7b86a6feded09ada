"""Every Python snippet of the README and of the docs site (docs/) runs as written.

Each runs in a process of its own against a database of its own on the test PostgreSQL
(the outbox tables migrated, as the README's set-up leaves them), given the one name the
README says its snippets share: ``dsn``. The provider keys they read are dummies; no
snippet reaches a provider (a dispatcher finds no due job, or none of its effect). A
snippet a page marks ``<!-- illustrative: reason -->`` (on the line before its fence)
needs a service of its own and is only compiled; that list stays short and each one says why.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

import outbox

from .docs.support import own_database

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted(p for p in (ROOT / "docs").rglob("*.md")
                         if "tutorial/code" not in p.as_posix())]
MAX_ILLUSTRATIVE = 7
_BLOCK = re.compile(r"^(?P<indent> *)```python\n(?P<body>.*?)^(?P=indent)```", re.S | re.M)
_ILLUSTRATIVE = re.compile(r"<!-- illustrative: (?P<reason>[^>]+) -->\s*$")
# Only ``dsn``: a block imports everything else it uses (tests/docs/test_snippet_names.py).
PRELUDE = "dsn = __import__('os').environ['OUTBOX_DATABASE_URL']\n"


@dataclass(frozen=True)
class Snippet:
    page: Path
    line: int
    code: str
    illustrative: str | None

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def snippets() -> list[Snippet]:
    return [snippet for page in PAGES for snippet in _snippets_of(page)]


def _snippets_of(page: Path) -> list[Snippet]:
    text = page.read_text()
    found = []
    for match in _BLOCK.finditer(text):
        before = text[:match.start()].rstrip("\n ").rsplit("\n", 1)[-1]
        marked = _ILLUSTRATIVE.search(before)
        found.append(Snippet(page, text.count("\n", 0, match.start()) + 1,
                             textwrap.dedent(match["body"]),
                             marked["reason"] if marked else None))
    return found


SNIPPETS = snippets()


def test_the_readme_and_docs_have_snippets_and_few_are_illustrative() -> None:
    assert len(SNIPPETS) >= 15
    assert any(s.page == README for s in SNIPPETS)
    illustrative = [s for s in SNIPPETS if s.illustrative]
    assert len(illustrative) <= MAX_ILLUSTRATIVE, [str(s) for s in illustrative]


@pytest.fixture
def database(dsn: str) -> Iterator[str]:
    """A database of its own, with the outbox tables in the default schema."""
    with own_database(dsn, "readme") as conninfo:
        url = _url(conninfo)
        with psycopg.connect(url, autocommit=True) as conn:
            outbox.migrate(conn)
        yield url


def _url(conninfo: str) -> str:
    """A ``postgresql://`` URL, as ``outbox dev-server url`` gives (the SQLAlchemy
    snippet turns it into an engine URL)."""
    params = conninfo_to_dict(conninfo)
    host = params.pop("host", "")
    port = params.pop("port", "")
    user = params.pop("user", "")
    password = params.pop("password", "")
    dbname = params.pop("dbname", "")
    query = "&".join(f"{k}={v}" for k, v in {"host": host, **params}.items() if v)
    auth = f"{user}:{password}@" if password else f"{user}@" if user else ""
    return f"postgresql://{auth}/{dbname}?{query}" + (f"&port={port}" if port else "")


@pytest.mark.parametrize("snippet", SNIPPETS, ids=str)
def test_the_snippet_runs_as_written(snippet: Snippet, database: str, tmp_path: Path) -> None:
    code = PRELUDE + snippet.code
    if snippet.illustrative:
        compile(code, str(snippet), "exec")  # at least well-formed Python
        return
    env = {**os.environ, "OUTBOX_DATABASE_URL": database, "RESEND_API_KEY": "re_dummy",
           "STRIPE_API_KEY": "sk_test_dummy"}
    done = subprocess.run([sys.executable, "-W", "error", "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, f"{snippet} failed:\n{done.stderr[-3000:]}"
