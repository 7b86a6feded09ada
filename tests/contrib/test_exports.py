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


TENANTS_ON_DEMAND = """
import sys
from django.conf import settings
settings.configure()
import outbox.contrib.django as integration
print(sorted(m for m in sys.modules if m.partition(".")[0] == "django_tenants"))
sys.modules["django_tenants"] = None  # as if outbox-pg[django-tenants] were not installed
try:
    integration.tenant_targets()
except ModuleNotFoundError as exc:
    print(f"{exc.name.partition('.')[0]}|{exc}")
"""


def test_the_django_integration_imports_django_tenants_for_tenant_targets_only() -> None:
    done = subprocess.run([sys.executable, "-c", TENANTS_ON_DEMAND], capture_output=True,
                          text=True, timeout=60, check=True)
    assert done.stdout.splitlines() == [
        "[]",
        "django_tenants|outbox.contrib.django.tenant_targets needs django_tenants, which is "
        "not installed: pip install 'outbox-pg[django-tenants]'"]
