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


def _text(html_source: str) -> str:
    """The text of some HTML with every space taken out (a signature's and a table's
    words are spaced by their markup)."""
    return re.sub(r"\s+", "", re.sub(r"<[^>]+>", " ", html_source)).replace("&#39;", "'")


def test_the_dispatcher_reference_shows_its_signature_and_parameter_table(site: Path) -> None:
    page = (site / "reference" / "outbox.html").read_text()
    for name in ("Dispatcher", "AsyncDispatcher"):
        start = page.index(f'id="outbox.{name}"')
        section = page[start:page.index("</table>", start)]
        signature = _text(section[:section.index("doc-contents")])
        assert f"{name}(conninfo:str|None=None," in signature, signature[:300]
        assert "stop_timeout:float|timedelta=30.0," in signature, name
        table = _text(section[section.index("<table"):])
        assert "NameTypeDescriptionDefault" in table, table[:300]
        for row in ("stop_timeoutfloat|timedeltaHowlong", "max_connectionsintThemost",
                    "leasefloat|timedeltaAclaim"):
            assert row in table, (name, row)


# The public classes whose reference shows a parameter table: each ``__init__`` parameter
# has a ``:param name:`` line in the docstring of the ``__init__`` that takes it (for the
# dispatchers, their shared base's in outbox/dispatcher.py; for a dataclass, in the
# class docstring), and each pydantic payload
# field a ``:var name:`` line in its class docstring.
_WITH_PARAMETERS = ("outbox.Dispatcher", "outbox.AsyncDispatcher", "effects.email.SendEmail",
                    "effects.payments.ChargeCard", "effects.payments.RefundPayment",
                    "effects.webhook.PostWebhook", "effects.testing.FakeStripe",
                    "effects.testing.FakeEmailProvider", "outbox.Limit", "outbox.Target",
                    "effects.nats.PublishEvent", "effects.kafka.Produce", "outbox.Backoff",
                    "effects.testing.FakeWebhookReceiver", "effects.nats.InboxConsumer",
                    "effects.kafka.InboxConsumer")
_WITH_FIELDS = ("effects.email.EmailPayload", "effects.payments.ChargePayload")


def _public(path: str) -> type:
    import importlib

    module, _, name = path.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    assert isinstance(cls, type)
    return cls


@pytest.mark.parametrize("path", _WITH_PARAMETERS)
def test_every_parameter_of_a_public_class_is_documented(path: str) -> None:
    import inspect

    cls = _public(path)
    init = cls.__init__  # type: ignore[misc]
    documented = set(re.findall(r":param (\w+):", (init.__doc__ or "") + (cls.__doc__ or "")))
    taken = [p.name for p in list(inspect.signature(init).parameters.values())[1:]
             if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    missing = [name for name in taken if name not in documented]
    assert not missing, (
        f"{path}: no ':param NAME: what it is (with its unit)' line for {missing} in the "
        f"docstring of {init.__qualname__} ({inspect.getsourcefile(cls)}): the "
        "reference's parameter table is built from those lines")


@pytest.mark.parametrize("path", _WITH_FIELDS)
def test_every_field_of_a_payload_is_documented(path: str) -> None:
    cls = _public(path)
    documented = set(re.findall(r":var (\w+):", cls.__doc__ or ""))
    fields = getattr(cls, "model_fields", {})
    missing = [name for name in fields if name not in documented]
    assert fields and not missing, f"{path}: no ':var NAME:' line for {missing}"


def test_search_works_from_the_file_system(site: Path, tmp_path: Path) -> None:
    """site/index.html opened as a file (no server), as the README says: typing in the
    search box lists pages (Material's offline plugin ships the index as a script)."""
    chromium = "/usr/bin/chromium"
    if not Path(chromium).exists():
        pytest.skip("needs Debian's chromium: apt-get update && apt-get install -y chromium")
    from playwright.sync_api import sync_playwright

    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync"]
    shots = Path(os.environ.get("OUTBOX_SCREENSHOTS") or tmp_path)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=flags)
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        errors: list[str] = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.goto((site / "index.html").as_uri())
        page.locator("input.md-search__input").click()
        page.keyboard.type("reconcile")  # keystrokes: the search listens to key events
        results = page.locator(".md-search-result__item")
        results.first.wait_for(timeout=30_000)
        count = results.count()
        first = results.first.locator("a").first.get_attribute("href") or ""
        page.screenshot(path=str(shots / "search-from-file.png"))
        browser.close()
    assert count >= 1
    assert first.startswith("file://") and ".html" in first, first
    assert not errors, errors


def test_numbered_steps_render_as_one_list(site: Path) -> None:
    """A step's code block or second paragraph indented 4 spaces stays in the step; at 3
    it ends the list and every later step renders as "1." again (one more <ol>)."""
    broken = []
    for page in (ROOT / "docs").rglob("*.md"):
        lists = len(re.findall(r"^1\. ", page.read_text(), re.M))
        html_page = site / page.relative_to(ROOT / "docs").with_suffix(".html")
        if not lists or not html_page.exists():
            continue
        content = html_page.read_text().split('class="md-content"', 1)[-1]
        rendered = len(re.findall(r"<ol>", content))
        if rendered != lists:
            broken.append(f"{page.relative_to(ROOT)}: {lists} numbered list(s) in the "
                          f"text, {rendered} rendered (indent a step's continuation 4 spaces)")
    assert not broken, broken


# The public records: each field, with its type and meaning, in a table of the reference
# (``:var name:`` lines give an "Attributes" table, for the records outbox hands out;
# ``:param name:`` lines a "Parameters" table, for those an application builds).
_RECORDS = {"Job": "Attributes", "DispatchStats": "Attributes", "EnqueueResult": "Attributes",
            "FailedParent": "Attributes", "Performed": "Attributes", "NewJob": "Parameters",
            "Schedule": "Parameters", "Limit": "Parameters", "Target": "Parameters",
            "Backoff": "Parameters"}


def _record_fields(name: str) -> list[tuple[str, str]]:
    """Each field an application sees or gives: (name, its annotation as written)."""
    import dataclasses
    import typing

    import outbox

    cls = getattr(outbox, name)
    hints = typing.get_type_hints(cls)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(cls)
            if f.init and f.name != "_"]


def test_every_public_record_is_in_the_table() -> None:
    """Every dataclass of ``outbox.__all__`` is listed above, so a new record gets its
    table too."""
    import dataclasses

    import outbox

    records = sorted(n for n in outbox.__all__ if dataclasses.is_dataclass(getattr(outbox, n))
                     and dataclasses.fields(getattr(outbox, n)))
    assert records == sorted(_RECORDS), "add the record to _RECORDS and document its fields"


@pytest.mark.parametrize("name", sorted(_RECORDS))
def test_a_record_documents_every_field(name: str) -> None:
    import outbox

    cls = getattr(outbox, name)
    marker = ":var" if _RECORDS[name] == "Attributes" else ":param"
    documented = set(re.findall(rf"{marker} (\w+):", cls.__doc__ or ""))
    missing = [field for field, _ in _record_fields(name) if field not in documented]
    assert not missing, (f"outbox.{name}: no '{marker} NAME: what it is' line in its "
                         f"docstring for {missing}: the reference's table is built from them")


def test_the_records_show_their_fields_in_a_table(site: Path) -> None:
    page = (site / "reference" / "outbox.html").read_text()
    for name, section_title in _RECORDS.items():
        start = page.index(f'id="outbox.{name}"')
        section = page[start:page.index("</table>", start)]
        table = section[section.index("<table"):]
        assert f"{section_title}:NameTypeDescription" in _text(section), name
        rows = {_text(field): (_text(kind), _text(meaning)) for field, kind, meaning in
                re.findall(r"<tr[^>]*>\s*<td[^>]*>(.*?)</td>\s*<td[^>]*>(.*?)</td>\s*"
                           r"<td[^>]*>(.*?)</td>", table, re.S)}
        for field, _ in _record_fields(name):
            kind, meaning = rows.get(field, ("", ""))
            assert kind and meaning, (name, field, sorted(rows))
    # Rows read whole: the name, its type, its meaning.
    job = _text(page[page.index('id="outbox.Job"'):])
    assert "attemptintWhichclaimthisis,from1." in job
    stats = _text(page[page.index('id="outbox.DispatchStats"'):])
    assert "doneintJobsrecordeddone." in stats
