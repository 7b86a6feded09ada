"""Schedules without a database: construction errors, slots, catch-up, DST (explicit
instants, no clock)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

import outbox
from outbox.schedules import MAX_CATCH_UP, ON_TIME, Schedule, slot_key

BERLIN = ZoneInfo("Europe/Berlin")


def utc(year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0,
        micro: int = 0) -> datetime:
    return datetime(year, month, day, hour, minute, second, micro, tzinfo=UTC)


def local(year: int, month: int, day: int, hour: int = 0, minute: int = 0, *,
          fold: int = 0) -> datetime:
    return datetime(year, month, day, hour, minute, tzinfo=BERLIN, fold=fold)


# -- bad input, at construction, naming the schedule -------------------------------------------


@pytest.mark.parametrize(("options", "expected"), [
    ({"cron": "61 * * * *"}, "not a valid cron expression"),
    ({"cron": "0 3 * *"}, "needs five"),
    ({"cron": "0 0 3 * * *"}, "needs five"),
    ({"cron": "0 3 * * *", "every": 60}, "not both"),
    ({}, "got neither"),
    ({"every": 60, "timezone": "Mars/Olympus"}, "unknown time zone 'Mars/Olympus'"),
    ({"every": 0}, "more than 0 seconds"),
    ({"every": -5}, "more than 0 seconds"),
    ({"every": timedelta(0)}, "more than 0 seconds"),
    ({"every": "60"}, "seconds (a number) or a timedelta"),
    # past a century the slots leave the calendar: the scheduler died on each of these
    ({"every": 1e12}, "every must be at most a century (3155760000 seconds), got 1000000000000.0"),
    ({"every": timedelta.max}, "every must be at most a century"),
    ({"every": float("inf")}, "every must be at most a century"),
    ({"every": 10**400}, "at most a century (3155760000 seconds), got an integer of 1329 bits"),
    ({"every": 60, "catch_up": "some"}, "catch_up must be one of"),
    ({"every": 60, "priority": 5000}, "priority"),
    ({"every": 60, "group": ""}, "group"),
    ({"every": 60, "payload": {"x": float("nan")}}, "NaN"),
    ({"every": 60, "effect": ""}, "effect must be"),
    # refused by the database at every pass of the scheduler before, naming nothing
    ({"every": 60, "effect": "a\x00b"},
     "effect name 'a\\x00b' has a character that is not printable"),
    ({"every": 60, "group": "g\x00"}, "group 'g\\x00' holds a NUL character"),
])
def test_bad_input_is_refused_at_construction_naming_the_schedule(
        options: dict[str, object], expected: str) -> None:
    arguments: dict[str, object] = {"effect": "email.send", **options}
    with pytest.raises(outbox.ConfigurationError) as raised:
        Schedule("nightly-charge", **arguments)  # type: ignore[arg-type]
    assert "schedule 'nightly-charge'" in str(raised.value)
    assert expected in str(raised.value)


def test_a_name_must_fit_a_key() -> None:
    with pytest.raises(outbox.ConfigurationError, match="name"):
        Schedule("", effect="e", every=1)
    with pytest.raises(outbox.ConfigurationError, match="printable ASCII"):
        Schedule("nächtlich", effect="e", every=1)
    with pytest.raises(outbox.ConfigurationError, match="at most 200"):
        Schedule("n" * 201, effect="e", every=1)


def test_the_definition_round_trips() -> None:
    schedule = Schedule("invoices", effect="invoice.send", cron="0 6 1 * *",
                        timezone="Europe/Berlin", payload={"run": "monthly"}, catch_up="all",
                        group="tenant-7", priority=3)
    assert Schedule.from_definition("invoices", schedule.definition()) == schedule
    assert schedule.describe() == "cron 0 6 1 * * Europe/Berlin"
    minutely = Schedule("s", effect="e", every=timedelta(minutes=1))
    assert minutely.describe() == "every 60s"
    assert Schedule.from_definition("s", minutely.definition()) == minutely  # every=60.0


# -- slots ----------------------------------------------------------------------------------


def test_every_slots_are_aligned_to_the_epoch() -> None:
    hourly = Schedule("h", effect="e", every=3600, timezone="Asia/Kolkata")
    assert hourly.next_after(utc(2026, 12, 5, 10, 17, 3)) == utc(2026, 12, 5, 11)
    assert hourly.next_after(utc(2026, 12, 5, 11)) == utc(2026, 12, 5, 12)  # strictly after


def test_slot_keys_name_the_schedule_and_the_utc_instant() -> None:
    assert slot_key("nightly", local(2026, 12, 5, 3)) == "schedule:nightly:2026-12-05T02:00:00Z"
    assert (slot_key("fast", utc(2026, 1, 1, 0, 0, 0) + timedelta(microseconds=500000))
            == "schedule:fast:2026-01-01T00:00:00.500000Z")


def test_catch_up_all_enqueues_every_missed_slot_oldest_first() -> None:
    schedule = Schedule("s", effect="e", every=1, catch_up="all")
    plan = schedule.plan(utc(2026, 1, 1, 0, 0, 10), utc(2026, 1, 1, 0, 0, 16, 400000))
    assert plan.slots == tuple(utc(2026, 1, 1, 0, 0, s) for s in range(10, 17))
    assert plan.skipped == 0
    assert plan.next_slot == utc(2026, 1, 1, 0, 0, 17)


def test_catch_up_all_is_bounded_to_the_most_recent_slots() -> None:
    schedule = Schedule("s", effect="e", every=1, catch_up="all")
    plan = schedule.plan(utc(2026, 1, 1), utc(2026, 1, 1, 1))  # 3601 slots due
    assert len(plan.slots) == MAX_CATCH_UP
    assert plan.slots[-1] == utc(2026, 1, 1, 1)
    assert plan.skipped == 3601 - MAX_CATCH_UP
    minutely = Schedule("m", effect="e", cron="* * * * *", catch_up="all")
    plan = minutely.plan(utc(2026, 1, 1), utc(2026, 1, 2))  # a day and one minute
    assert (len(plan.slots), plan.skipped) == (MAX_CATCH_UP, 1441 - MAX_CATCH_UP)
    assert plan.slots[-1] == utc(2026, 1, 2)


def test_catch_up_latest_enqueues_only_the_latest_missed_slot() -> None:
    schedule = Schedule("s", effect="e", every=1)
    plan = schedule.plan(utc(2026, 1, 1, 0, 0, 10), utc(2026, 1, 1, 0, 0, 16, 400000))
    assert plan.slots == (utc(2026, 1, 1, 0, 0, 16),)
    assert plan.skipped == 6


def test_catch_up_skip_enqueues_only_a_slot_on_time() -> None:
    daily = Schedule("d", effect="e", cron="0 3 * * *", timezone="Europe/Berlin",
                     catch_up="skip")
    slot = local(2026, 12, 5, 3)
    on_time = daily.plan(slot, slot + timedelta(seconds=ON_TIME - 1))
    assert on_time.slots == (slot.astimezone(UTC),)
    late = daily.plan(slot, slot + timedelta(hours=2))
    assert (late.slots, late.skipped) == ((), 1)
    assert late.next_slot == local(2026, 12, 6, 3).astimezone(UTC)


def test_nothing_due_keeps_the_next_slot() -> None:
    schedule = Schedule("s", effect="e", every=60)
    plan = schedule.plan(utc(2026, 1, 1, 0, 1), utc(2026, 1, 1, 0, 0, 30))
    assert plan == type(plan)((), 0, utc(2026, 1, 1, 0, 1))


# -- daylight saving time (Europe/Berlin: 2026-03-29 02:00 -> 03:00; 2026-10-25 03:00 -> 02:00)


def test_a_skipped_local_time_fires_once_right_after_the_jump() -> None:
    nightly = Schedule("n", effect="e", cron="30 2 * * *", timezone="Europe/Berlin")
    before = local(2026, 3, 28, 12)
    slots = [nightly.next_after(before)]
    slots.append(nightly.next_after(slots[0]))
    # 02:30 does not exist on the 29th: it fires at 03:00 CEST (01:00 UTC), then as usual.
    assert slots == [utc(2026, 3, 29, 1), local(2026, 3, 30, 2, 30).astimezone(UTC)]


def test_a_repeated_local_time_fires_once_at_its_first_occurrence() -> None:
    nightly = Schedule("n", effect="e", cron="30 2 * * *", timezone="Europe/Berlin")
    first = nightly.next_after(local(2026, 10, 24, 12))
    assert first == local(2026, 10, 25, 2, 30, fold=0).astimezone(UTC) == utc(2026, 10, 25, 0, 30)
    # Not again at the second 02:30 (CET, 01:30 UTC): next is the 26th.
    assert nightly.next_after(first) == utc(2026, 10, 26, 1, 30)
    # Caught up over the whole night (all): one slot, not two.
    plan = Schedule("n", effect="e", cron="30 2 * * *", timezone="Europe/Berlin",
                    catch_up="all").plan(utc(2026, 10, 24, 23), utc(2026, 10, 25, 5))
    assert plan.slots == (utc(2026, 10, 25, 0, 30),)


def test_a_wildcard_hour_follows_real_time_through_both_changes() -> None:
    half_hourly = Schedule("h", effect="e", cron="*/30 * * * *", timezone="Europe/Berlin",
                           catch_up="all")
    autumn = half_hourly.plan(utc(2026, 10, 24, 23, 30), utc(2026, 10, 25, 2))
    # The repeated hour 02:00-03:00 local runs twice: every half hour of real time.
    assert autumn.slots == tuple(utc(2026, 10, 24, 23, 30) + timedelta(minutes=30 * i)
                                 for i in range(6))
    spring = half_hourly.plan(utc(2026, 3, 28, 23, 30), utc(2026, 3, 29, 1, 30))
    assert spring.slots == tuple(utc(2026, 3, 28, 23, 30) + timedelta(minutes=30 * i)
                                 for i in range(5))
    # Started inside the repeated hour (its second pass), the next slot is still the next
    # half hour of real time.
    assert half_hourly.next_after(utc(2026, 10, 25, 1, 10)) == utc(2026, 10, 25, 1, 30)


def test_every_ignores_the_time_zone_and_its_changes() -> None:
    hourly = Schedule("h", effect="e", every=3600, timezone="Europe/Berlin", catch_up="all")
    plan = hourly.plan(utc(2026, 10, 24, 23), utc(2026, 10, 25, 3))
    assert plan.slots == tuple(utc(2026, 10, 24, 23) + timedelta(hours=i) for i in range(5))


def test_a_cron_catch_up_after_a_long_outage_looks_back_only_as_far_as_it_needs() -> None:
    """A year of a minutely schedule is not walked slot by slot: "all" keeps the latest
    thousand of the last day, "latest" the last slot; the older are skipped, uncounted."""
    start, now = utc(2025, 1, 1), utc(2026, 1, 1, 12, 0, 30)
    every_minute = Schedule("m", effect="e", cron="* * * * *", catch_up="all")
    plan = every_minute.plan(start, now)
    assert plan.slots == tuple(utc(2026, 1, 1, 12) - timedelta(minutes=999 - i)
                               for i in range(1000))
    assert plan.more_skipped and plan.skipped == 1440 - 1000
    assert plan.next_slot == utc(2026, 1, 1, 12, 1)
    latest = Schedule("l", effect="e", cron="* * * * *").plan(start, now)
    assert latest.slots == (utc(2026, 1, 1, 12),) and latest.more_skipped
    # A yearly slot four years back is still found, its window growing eightfold.
    yearly = Schedule("y", effect="e", cron="0 0 1 1 *", catch_up="all")
    plan = yearly.plan(utc(2022, 1, 1), utc(2025, 6, 1))
    assert plan.slots[-1] == utc(2025, 1, 1) and plan.slots[0] >= utc(2022, 1, 1)
    exact = yearly.plan(utc(2022, 1, 1), utc(2022, 6, 1))
    assert (exact.slots, exact.skipped, exact.more_skipped) == ((utc(2022, 1, 1),), 0, False)
