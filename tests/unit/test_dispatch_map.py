"""The dispatcher package's docstring is its map: every module of it is listed there, and
nothing that is not a module."""

from __future__ import annotations

import re
from pathlib import Path

import outbox.dispatcher  # noqa: F401 - the package is imported through its public user

PACKAGE = Path(__file__).resolve().parents[2] / "outbox" / "_dispatch"


def test_the_map_lists_every_module_of_the_dispatcher_and_no_other() -> None:
    doc = (PACKAGE / "__init__.py").read_text("utf-8").split('"""')[1]
    listed = set(re.findall(r"^    ([a-z_]+) {1,}\S", doc, re.M))
    modules = {path.stem for path in PACKAGE.glob("*.py")} - {"__init__"}
    assert listed == modules
