"""The job list's filters: parsed from a query string, checked, turned into parameters.

Pure functions, no I/O. Anything an operator can type is validated here, so a bad value
gets a message naming the field instead of a database error.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

STATUSES = ("pending", "running", "done", "failed", "reconcile")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_TEXT = 255


class FilterError(ValueError):
    """A filter value the dashboard cannot use; the message names the field."""


def parse_duration(value: str, field: str) -> float:
    """``"90s"``, ``"15m"``, ``"2h"``, ``"7d"`` (or plain seconds) in seconds."""
    match = _DURATION.match(value)
    if not match:
        raise FilterError(f"{field}: {value[:40]!r} is not a duration like 90s, 15m, 2h or 7d")
    return float(match[1]) * _UNIT_SECONDS[match[2]]


@dataclass(frozen=True)
class JobFilter:
    """What the job list shows; empty fields filter nothing."""

    status: str = ""
    effect: str = ""
    key_prefix: str = ""
    older_than: str = ""
    newer_than: str = ""
    error: str = ""

    @classmethod
    def from_query(cls, query: Mapping[str, str]) -> JobFilter:
        """Read the filter from request parameters, raising FilterError on a bad one."""
        values = {f.name: str(query.get(f.name, "")).strip() for f in fields(cls)}
        for name, value in values.items():
            if len(value) > MAX_TEXT:
                raise FilterError(f"{name}: longer than {MAX_TEXT} characters")
            if "\x00" in value:
                raise FilterError(f"{name}: contains a NUL character")
        if values["status"] and values["status"] not in STATUSES:
            raise FilterError(f"status: must be one of {', '.join(STATUSES)}")
        made = cls(**values)
        made.params()  # validates the durations
        return made

    def params(self) -> dict[str, Any]:
        """Bind parameters of the ``job_filter`` SQL block (None disables a condition)."""
        return {
            "status": self.status or None,
            "effect": self.effect or None,
            "key_prefix": self.key_prefix or None,
            "older_than": parse_duration(self.older_than, "older than")
            if self.older_than else None,
            "newer_than": parse_duration(self.newer_than, "newer than")
            if self.newer_than else None,
            "error": self.error or None,
        }

    def query(self) -> dict[str, str]:
        """The non-empty fields, for links and hidden form fields."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name)}

    def describe(self) -> dict[str, str]:
        """The same, keyed for the audit trail."""
        return self.query()
