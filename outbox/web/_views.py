"""Pure helpers the templates use: payload display, ages, the per-minute chart."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

Redactor = Callable[[str, Any], Any]
"""``redact(effect, payload)``: what the job page shows instead of the payload."""

PAYLOAD_PREVIEW_CHARS = 2000


def truncate_payload(effect: str, payload: Any) -> str:
    """The default redactor: the payload as indented JSON, cut at 2000 characters."""
    text = json.dumps(payload, indent=2, ensure_ascii=False, sort_keys=True)
    if len(text) <= PAYLOAD_PREVIEW_CHARS:
        return text
    hidden = len(text) - PAYLOAD_PREVIEW_CHARS
    return f"{text[:PAYLOAD_PREVIEW_CHARS]}\n... ({hidden} more characters not shown)"


def shown_payload(redact: Redactor, effect: str, payload: Any) -> str:
    """Apply ``redact``; text is shown as is, anything else as JSON (escaped either way)."""
    try:
        shown = redact(effect, payload)
    except Exception as exc:  # a faulty redactor must not leak the raw payload
        return f"(redact failed: {type(exc).__name__}; payload hidden)"
    if isinstance(shown, str):
        return shown
    return json.dumps(shown, indent=2, ensure_ascii=False, sort_keys=True, default=str)


def age(moment: datetime | None, now: datetime | None = None) -> str:
    """``42s``, ``5m``, ``3h``, ``2d``: how long ago (or, negative, how far ahead)."""
    if moment is None:
        return "-"
    seconds = ((now or datetime.now(UTC)) - moment).total_seconds()
    return seconds_text(seconds)


def ago(moment: datetime | None, now: datetime | None = None) -> str:
    """``5m ago`` for the past, ``in 5m`` for the future."""
    text = age(moment, now)
    return text if text == "-" or text.startswith("in ") else f"{text} ago"


def seconds_text(seconds: float | None) -> str:
    """A duration in its largest whole unit, ``in 5m`` when negative."""
    if seconds is None:
        return "-"
    ahead, seconds = seconds < 0, abs(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            text = f"{int(seconds // size)}{unit}"
            break
    else:
        text = f"{int(seconds)}s"
    return f"in {text}" if ahead else text


def timestamp(moment: datetime | None) -> str:
    """UTC, to the second."""
    if moment is None:
        return "-"
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


@dataclass(frozen=True)
class Bar:
    """One minute of the chart, in SVG user units."""

    x: float
    done_y: float
    done_h: float
    failed_y: float
    failed_h: float
    label: str


@dataclass(frozen=True)
class Chart:
    """Per-minute done and failed jobs over the last hour, as stacked bars."""

    bars: tuple[Bar, ...]
    peak: int
    done: int
    failed: int
    width: int
    height: int

    @property
    def failure_rate(self) -> float | None:
        """Failed over settled jobs in the window, None when nothing settled."""
        settled = self.done + self.failed
        return self.failed / settled if settled else None


class Minute(Protocol):
    """Jobs settled in one minute (the dashboard's ``Settled`` rows)."""

    @property
    def minute(self) -> datetime: ...

    @property
    def done(self) -> int: ...

    @property
    def failed(self) -> int: ...


def minute_chart(rows: Sequence[Minute], since: datetime,
                 minutes: int = 60, width: int = 600, height: int = 120) -> Chart:
    """Bars for ``rows`` (each a minute's done and failed); minutes without rows are
    empty."""
    by_minute = {int((row.minute - since).total_seconds() // 60): (row.done, row.failed)
                 for row in rows}
    peak = max((d + f for d, f in by_minute.values()), default=0)
    scale = (height - 2) / peak if peak else 0.0
    slot = width / minutes
    bars = []
    for i in range(minutes):
        done, failed = by_minute.get(i, (0, 0))
        done_h, failed_h = done * scale, failed * scale
        moment = since + timedelta(minutes=i)
        bars.append(Bar(
            x=round(i * slot + 1, 2),
            done_y=round(height - done_h, 2), done_h=round(done_h, 2),
            failed_y=round(height - done_h - failed_h, 2), failed_h=round(failed_h, 2),
            label=f"{moment:%H:%M}Z: {done} done, {failed} failed",
        ))
    total_done = sum(d for d, _ in by_minute.values())
    total_failed = sum(f for _, f in by_minute.values())
    return Chart(tuple(bars), peak, total_done, total_failed, width, height)
