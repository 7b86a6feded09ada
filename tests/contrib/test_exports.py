"""The integrations' public surface, and a core that imports none of them."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

CONTRIB = ["outbox.contrib.sqlalchemy", "outbox.contrib.django"]


@pytest.mark.parametrize("package", CONTRIB)
def test_all_is_sorted_exists_and_is_documented(package: str) -> None:
    module = importlib.import_module(package)
    assert module.__all__ == sorted(module.__all__)
    for name in module.__all__:
        assert getattr(module, name).__doc__, f"{package}.{name} has no docstring"


def test_import_outbox_imports_no_integration() -> None:
    code = ("import sys, outbox; "
            "print(sorted(m for m in ('sqlalchemy', 'django', 'fastapi') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"
