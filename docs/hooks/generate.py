"""Generated reference pages: each ``<!-- generate: NAME -->`` line of a page is replaced
by text built from the code itself (the click parser, the metric families, the span
attributes), so the reference cannot drift from what the code does."""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

ROOT = Path(__file__).resolve().parents[2]
_MARKER = re.compile(r"^<!-- generate: (?P<name>[a-z-]+) -->$", re.M)
# A tutorial file shown whole, as the tests run it (tests/docs/test_tutorial.py).
_INCLUDE = re.compile(r"^<!-- include: (?P<path>[a-z_/]+\.py) -->$", re.M)
TUTORIAL_CODE = ROOT / "docs" / "tutorial" / "code"


Found = tuple[click.Context, click.Command]


def _commands(group: click.Command, ctx: click.Context) -> Iterator[Found]:
    yield ctx, group
    if isinstance(group, click.Group):
        for name in group.list_commands(ctx):
            command = group.get_command(ctx, name)
            if command is None or command.hidden:
                continue
            yield from _commands(command, click.Context(command, info_name=name, parent=ctx))


def cli() -> str:
    """Every command's ``--help``, exactly as the parser prints it."""
    from outbox.cli import main

    parts = []
    root = click.Context(main, info_name="outbox", terminal_width=100, max_content_width=100)
    for ctx, command in _commands(main, root):
        path = ctx.command_path
        level = "#" * min(2 + path.count(" "), 4)
        parts.append(f"{level} `{path}`\n\n```text\n{command.get_help(ctx)}\n```\n")
    return "\n".join(parts)


def _families(tree: ast.AST) -> Iterator[tuple[str, str, str, list[str]]]:
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id.endswith("MetricFamily")):
            continue
        name, help_text = (a.value for a in node.args[:2] if isinstance(a, ast.Constant))
        labels: list[str] = []
        for keyword in node.keywords:
            if keyword.arg == "labels" and isinstance(keyword.value, ast.List):
                labels = [str(e.value) for e in keyword.value.elts if isinstance(e, ast.Constant)]
        kind = node.func.id.removesuffix("MetricFamily").lower()
        yield str(name), kind, str(help_text), labels


def metrics() -> str:
    """Every metric family ``outbox.metrics`` exports, read from its source."""
    rows = ["| metric | type | labels | meaning |", "| --- | --- | --- | --- |"]
    for path in sorted((ROOT / "outbox").glob("*metrics.py")):
        for name, kind, help_text, labels in _families(ast.parse(path.read_text())):
            shown = ", ".join(f"`{label}`" for label in labels) or "(none)"
            rows.append(f"| `{name}` | {kind} | {shown} | {help_text} |")
    return "\n".join(rows) + "\n"


_ATTRIBUTE = re.compile(r"\"((?:outbox|messaging|error)\.[a-z_.]+)\"")
_SPAN = re.compile(r"f\"((?:send|process) \{effect\})\"")


def spans() -> str:
    """The span names and every attribute ``outbox.tracing`` sets, read from its source."""
    source = (ROOT / "outbox" / "tracing.py").read_text()
    names = sorted(set(_SPAN.findall(source)))
    attributes = sorted(set(_ATTRIBUTE.findall(source)))
    return ("Spans: " + ", ".join(f"`{n}`" for n in names) + ".\n\n"
            + "Attributes: " + ", ".join(f"`{a}`" for a in attributes) + ".\n")


GENERATORS: dict[str, Callable[[], str]] = {"cli": cli, "metrics": metrics, "spans": spans}


def _include(path: str) -> str:
    return f"```python title=\"{path}\"\n{(TUTORIAL_CODE / path).read_text()}```"


def on_page_markdown(markdown: str, **_: Any) -> str:
    markdown = _INCLUDE.sub(lambda m: _include(m["path"]), markdown)
    return _MARKER.sub(lambda m: GENERATORS[m["name"]](), markdown)
