"""Hypothesis keeps nothing in the repository.

Each test sets ``database=None``, so no examples are saved. Hypothesis still caches
other things (the constants it reads from loaded modules, at collection time, and unicode
tables) under its home directory, ``./.hypothesis`` by default; it is pointed at the
system's temporary directory here, at import, which is before that collection-time cache
is written. ``HYPOTHESIS_STORAGE_DIRECTORY``, when set, still wins.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from hypothesis import configuration

if not os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
    configuration.set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "outbox-tests-hypothesis")
