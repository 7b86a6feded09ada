"""Rows cross the SQL boundary as named records: no reader in ``outbox/`` counts columns.

A query's rows are read through psycopg's row factories (``class_row`` with a small
record, ``dict_row``, ``namedtuple_row``) or a step's ``Statement(row=...)``, so a reader
names each column it reads and a change to a query's columns fails where it is read,
not three positions later. This scan finds the positional forms in product code and
templates: a row indexed by a number (``row[0]``, ``rows[0][1]``,
``cursor.fetchone()[0]``, ``{{ j[3] }}``) and a wide row unpacked by position
(``for a, b, c in rows``).

``NOT_YET`` would list a module still reading rows by position, saying why: none does.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "outbox"

# Names a reader gives one row of a query's result.
ROW_NAMES = frozenset({"row", "r", "rec", "record", "found_row"})
# Names a reader gives a query's result (a list of rows).
ROWS_NAMES = frozenset({"rows", "found", "result", "results", "fetched"})
WIDE = 3  # unpacking this many columns by position is counting them

NOT_YET: dict[str, str] = {
}

def positional_reads(source: str) -> list[int]:
    """The lines of Python ``source`` that read a query's row by position."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Subscript) and _number(node.slice) and _a_row(node.value):
            found.add(node.lineno)
        elif isinstance(node, ast.For | ast.comprehension) and _wide(node.target) and (
                _rows(node.iter)):
            found.add(getattr(node, "lineno", None) or node.iter.lineno)
        elif isinstance(node, ast.Assign) and any(_wide(t) for t in node.targets) and (
                _a_row(node.value)):
            found.add(node.lineno)
    return sorted(found)


def _number(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) is int


def _a_row(node: ast.expr) -> bool:
    """``row``, ``rows[0]``, ``cursor.fetchone()``: one row of a query's result."""
    if isinstance(node, ast.Name):
        return node.id in ROW_NAMES
    if isinstance(node, ast.Subscript):
        return _number(node.slice) and _rows(node.value)
    return _call_of(node, "fetchone")


def _rows(node: ast.expr) -> bool:
    """``rows``, ``cursor.fetchall()``, ``(await rows(...))``: a query's result."""
    if isinstance(node, ast.Name):
        return node.id in ROWS_NAMES
    if isinstance(node, ast.Await):
        return _rows(node.value)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        return node.func.id in ROWS_NAMES
    return _call_of(node, "fetchall")


def _call_of(node: ast.expr, method: str) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == method)


def _wide(target: ast.expr) -> bool:
    return isinstance(target, ast.Tuple) and len(target.elts) >= WIDE


_TEMPLATE_TAG = re.compile(r"\{\{.*?\}\}|\{%.*?%\}")
_INDEXED = re.compile(r"\b[A-Za-z_]\w*\[\d+\]")


def template_positional_reads(text: str) -> list[int]:
    """The lines of a Jinja template that index a value by a number inside a tag."""
    return [number for number, line in enumerate(text.splitlines(), 1)
            if any(_INDEXED.search(tag) for tag in _TEMPLATE_TAG.findall(line))]


@pytest.mark.parametrize("source", [
    "x = row[0]", "x = r[3]", "x = rows[0][1]", "x = found[0][0]",
    "x = cursor.fetchone()[0]", "x = (await rows(conn, q))[0][0]",
    "for a, b, c in rows:\n    pass", "y = [a for a, b, c in cur.fetchall()]",
    "a, b, c = rows[0]", "a, b, c, d = cursor.fetchone()",
])
def test_the_scan_finds_every_positional_form(source: str) -> None:
    assert positional_reads(source)


@pytest.mark.parametrize("source", [
    "x = row.id", "x = rows[0].id", "x = rows[0] if rows else None",
    "x = text.splitlines()[0]", "for key, value in rows:\n    pass",
    "x = match[1]", "held, _ = item", "{w.id for w in rows}",
])
def test_the_scan_lets_named_reads_through(source: str) -> None:
    assert not positional_reads(source)


def test_the_template_scan_finds_indexes_in_tags_only() -> None:
    assert template_positional_reads("<td>{{ j[3] }}</td>\n<td>{% if l[7] %}</td>") == [1, 2]
    assert not template_positional_reads("<td>{{ j.status }}</td>\n<p>see [1]</p>")


def _offenders() -> dict[str, list[str]]:
    offenders: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*")):
        name = path.relative_to(ROOT).as_posix()
        if name in NOT_YET or path.suffix not in (".py", ".html"):
            continue
        text = path.read_text("utf-8")
        lines = text.splitlines()
        numbers = (positional_reads(text) if path.suffix == ".py"
                   else template_positional_reads(text))
        found = [lines[n - 1].strip() for n in numbers]
        if found:
            offenders[name] = found
    return offenders


def test_no_reader_in_the_package_counts_columns() -> None:
    assert _offenders() == {}, (
        "read rows by name: class_row / dict_row / namedtuple_row, or Statement(row=...)")


def test_every_module_not_yet_converted_exists() -> None:
    missing = [name for name in NOT_YET if not (ROOT / name).exists()]
    assert not missing, f"gone or renamed, drop them from NOT_YET: {missing}"
