"""Where each effect's fair claim goes on: the group after which the next claim starts.

The claim walks an effect's busy groups in "C" (byte) order from this point, around to
it again (claim.sql, fragment fair_busy), so over successive claims every busy group
gets its turn however many groups there are. The point is this dispatcher's own: with
several dispatchers each goes round on its own, and every group still gets turns.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

__all__ = ["GroupTurns"]


class GroupTurns:
    """Per effect, the last group served (in walk order) by this dispatcher's claims."""

    def __init__(self) -> None:
        self._after: dict[str, str] = {}

    def json(self) -> str:
        """The claims' ``after`` parameter: a JSON object effect -> group."""
        return json.dumps(self._after, ensure_ascii=False)

    def resume_after(self, effect: str, group: str) -> None:
        """The next claim of ``effect`` starts after ``group`` (the last group a claim
        looked at, whether it took a job of it or not)."""
        self._after[effect] = group

    def served(self, claimed: Iterable[tuple[str, str | None]]) -> None:
        """Note the (effect, group) of each job a claim took: the next claim of the
        effect starts after the last of them in walk order. Python's str order is the
        code point order, which is "C" order on UTF-8 text, the walk's own order."""
        groups: dict[str, list[str]] = {}
        for effect, group in claimed:
            groups.setdefault(effect, []).append(group or "")
        for effect, names in groups.items():
            after = self._after.get(effect, "")
            later = [g for g in names if g > after]
            self._after[effect] = max(later) if later else max(names)
