"""The public surface: every exported name exists, is documented, and is listed sorted."""

from __future__ import annotations

import importlib

import pytest

PACKAGES = ["outbox", "effects", "effects.testing", "outbox.testing", "outbox.sql"]


@pytest.mark.parametrize("package", PACKAGES)
def test_all_is_sorted_and_complete(package: str) -> None:
    module = importlib.import_module(package)
    exported = module.__all__
    assert exported == sorted(exported)
    for name in exported:
        assert hasattr(module, name), f"{package}.{name} is listed but missing"
    public = {n for n in vars(module) if not n.startswith("_")}
    submodules = {n for n in public if type(getattr(module, n)).__name__ == "module"}
    assert public - submodules - set(exported) == set(), "public names missing from __all__"


@pytest.mark.parametrize("package", PACKAGES)
def test_public_names_have_docstrings(package: str) -> None:
    module = importlib.import_module(package)
    for name in module.__all__:
        assert getattr(module, name).__doc__, f"{package}.{name} has no docstring"


def test_contract_names_exist() -> None:
    import outbox

    for name in ["transaction", "Effect", "Job", "Retry", "Permanent", "UnknownOutcome",
                 "Dispatcher", "IdempotencyKeyConflict", "migrate"]:
        assert name in outbox.__all__


def test_core_does_not_import_effects() -> None:
    import pathlib

    core = pathlib.Path(importlib.import_module("outbox").__file__ or "").parent
    for path in core.rglob("*.py"):
        text = path.read_text()
        assert "import effects" not in text and "from effects" not in text, path
