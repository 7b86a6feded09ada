"""The unserved-effect warning's pacing: once per effect, again at a slow interval while
its jobs still wait, afresh after they stopped waiting (no database)."""

from __future__ import annotations

from outbox import Effect, Job
from outbox._dispatch.presence import REPEAT_INTERVAL, Presence, Unserved
from outbox._dispatch.settings import Settings


class Send(Effect):
    name = "email.send"

    def perform(self, job: Job) -> None:
        return None


def test_the_warning_repeats_at_a_slow_interval_while_jobs_wait() -> None:
    presence = Presence(Settings.build("dbname=unused", [Send()]))
    rows = [Unserved("email.sned", 3, 42.0), Unserved("pay.charge", 1, 5.0)]
    assert presence.warn(rows, now=1000.0) == ["email.sned", "pay.charge"]
    assert presence.warn(rows, now=1000.0 + REPEAT_INTERVAL - 1) == []
    assert presence.warn(rows[:1], now=1000.0 + REPEAT_INTERVAL) == ["email.sned"]
    assert presence.warn([], now=1000.0 + REPEAT_INTERVAL + 1) == []  # served now
    assert presence.warn(rows, now=1000.0 + REPEAT_INTERVAL + 2) == ["email.sned",
                                                                      "pay.charge"]
