"""The many-databases tests' fixture: databases of their own, dropped after the test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .support import Databases


@pytest.fixture
def databases(dsn: str) -> Iterator[Databases]:
    made = Databases(dsn)
    try:
        yield made
    finally:
        made.drop()
