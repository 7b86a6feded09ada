"""The chaos runner's pure parts: the seeded plan and schedule, fault parsing, verdicts."""

from __future__ import annotations

import random
from collections import Counter

import click
import pytest

import effects.chaos
from effects.chaos import ChaosConfig, parse_faults
from effects.chaos.config import FAULT_KINDS, GROUP_LIMITS, PROCESS_FAULTS, parse_limits
from effects.chaos.monitor import LeaseMonitor
from effects.chaos.runner import missing_faults
from effects.chaos.schedule import KILL_WINDOWS, build_schedule, group_name, plan_jobs
from outbox import Limit


def _plan_and_schedule(config: ChaosConfig) -> tuple[object, object]:
    rng = random.Random(config.seed)
    return plan_jobs(config, rng), build_schedule(config, rng)


def test_the_same_seed_replays_the_same_jobs_and_faults() -> None:
    config = ChaosConfig(jobs=500, duration=30, seed=7)
    assert _plan_and_schedule(config) == _plan_and_schedule(config)
    assert _plan_and_schedule(config) != _plan_and_schedule(ChaosConfig(jobs=500, duration=30,
                                                                        seed=8))


def test_the_plan_commits_exactly_the_jobs_asked_for_with_unique_keys() -> None:
    config = ChaosConfig(jobs=1234, duration=30, seed=1)
    plan = plan_jobs(config, random.Random(1))
    committed = plan.committed()
    assert len(committed) == 1234
    keys = [job.key for job in committed + plan.rolled_back()]
    assert len(keys) == len(set(keys))
    assert plan.rolled_back(), "some business transactions roll back"
    assert {job.effect for job in committed} == {"email.send", "payment.charge", "webhook.post",
                                                 "nats.publish", "kafka.produce"}
    assert any(job.decline_code for job in committed)
    assert all(batch.at <= 0.85 * config.duration for batch in plan.trickle)


def test_without_the_decline_fault_no_card_is_declined() -> None:
    config = ChaosConfig(jobs=2000, duration=30, seed=1, faults=parse_faults("kill"))
    assert not any(job.decline_code for job in plan_jobs(config, random.Random(1)).committed())


def test_every_enabled_kind_is_scheduled_and_kills_aim_at_every_window() -> None:
    config = ChaosConfig(jobs=500, duration=40, seed=3)
    events = build_schedule(config, random.Random(3))
    kinds = Counter(event.kind for event in events)
    for kind in FAULT_KINDS:
        if kind != "decline":  # a property of some payments, not an event
            assert kinds[kind] >= 1, kind
    assert {e.window for e in events if e.kind == "kill"} == set(KILL_WINDOWS)
    assert [e.at for e in events] == sorted(e.at for e in events)
    stops, thaws = kinds["stop"], kinds["cont"]
    assert stops == thaws == kinds["retire"]
    assert all(e.at <= 0.85 * config.duration for e in events if e.kind in PROCESS_FAULTS)


def test_fault_spacing_thins_the_schedule_but_keeps_every_kind() -> None:
    dense = Counter(e.kind for e in build_schedule(
        ChaosConfig(duration=400.0, deadline=500.0), random.Random(3)))
    sparse = Counter(e.kind for e in build_schedule(
        ChaosConfig(duration=400.0, deadline=500.0, fault_spacing=10.0), random.Random(3)))
    assert dense["kill"] == 100 and sparse["kill"] == 10  # one every 4 s, then every 40 s
    assert sparse["restart"] >= 1 and set(sparse) == set(dense)
    with pytest.raises(ValueError, match="fault spacing must be between 0.1 and 1000"):
        ChaosConfig(fault_spacing=0.0)


def test_only_the_chosen_faults_are_scheduled() -> None:
    config = ChaosConfig(jobs=500, duration=40, seed=3, faults=parse_faults("kill,5xx"))
    assert {e.kind for e in build_schedule(config, random.Random(3))} == {"kill", "5xx"}


def test_fault_names_are_parsed_and_checked() -> None:
    assert parse_faults("all") == parse_faults("") == frozenset(FAULT_KINDS)
    assert parse_faults("none") == frozenset()
    assert parse_faults(" kill , 429") == {"kill", "429"}
    with pytest.raises(ValueError, match="unknown fault kind"):
        parse_faults("kill,flood")


def test_an_enabled_fault_that_injected_nothing_is_a_violation() -> None:
    faults = {"kill": {"armed": 3, "injected": 3}, "5xx": {"armed": 4, "injected": 0},
              "restart": {"armed": 0, "injected": 0}}
    missing = missing_faults(faults, skipped={"restart": "not our server"})
    assert missing == ["5xx: enabled, armed 4, injected 0"]


def test_the_package_surface_is_sorted_documented_and_a_click_command() -> None:
    assert effects.chaos.__all__ == sorted(effects.chaos.__all__)
    for name in effects.chaos.__all__:
        assert getattr(effects.chaos, name).__doc__, name
    assert isinstance(effects.chaos.command, click.Command)
    assert effects.chaos.command.name == "chaos"


def test_groups_spread_the_same_jobs_with_a_heavy_group_and_some_priorities() -> None:
    plain = ChaosConfig(jobs=4000, duration=30, seed=9)
    grouped = ChaosConfig(jobs=4000, duration=30, seed=9, groups=20)
    without, with_groups = _plan_and_schedule(plain), _plan_and_schedule(grouped)
    assert with_groups[1] == without[1], "the same fault schedule"
    jobs = plan_jobs(grouped, random.Random(9)).committed()
    assert [(j.key, j.effect, j.payload) for j in jobs] == [
        (j.key, j.effect, j.payload) for j in plan_jobs(plain, random.Random(9)).committed()]
    assert all(j.group is None and j.priority == 0
               for j in plan_jobs(plain, random.Random(9)).committed())
    groups = Counter(job.group for job in jobs)
    assert 0.45 < groups[group_name(0)] / len(jobs) < 0.55
    assert 0.03 < groups[None] / len(jobs) < 0.07
    assert set(groups) == {None, *(group_name(n) for n in range(20))}
    priorities = Counter(job.priority for job in jobs)
    assert set(priorities) == {10, 0, -5}
    assert 0.04 < priorities[10] / len(jobs) < 0.06
    assert jobs == plan_jobs(grouped, random.Random(9)).committed(), "replayed by the seed"


def test_the_workers_limits_default_with_groups_and_are_parsed_as_outbox_run_reads_them() -> None:
    assert ChaosConfig().effect_limits == {}
    assert ChaosConfig(groups=3).effect_limits == dict(GROUP_LIMITS)
    assert ChaosConfig(groups=3, limits={}).effect_limits == {}
    assert parse_limits(["webhook.post=concurrency=3,per_group", "email.send=5/s"]) == {
        "webhook.post": Limit(concurrency=3, per_group=True), "email.send": Limit(rate=5.0)}
    assert parse_limits(["none"]) == {}
    with pytest.raises(ValueError, match="EFFECT=LIMIT"):
        parse_limits(["sms.send=2/s"])
    with pytest.raises(ValueError, match="limited twice"):
        parse_limits(["email.send=2/s", "email.send=3/s"])
    with pytest.raises(ValueError, match="no such effect"):
        ChaosConfig(limits={"sms.send": Limit(rate=1.0)})


def test_the_monitor_flags_a_sample_with_more_running_jobs_of_a_group_than_the_limit() -> None:
    monitor = LeaseMonitor("", None, limits={  # type: ignore[arg-type]
        "webhook.post": Limit(concurrency=2, per_group=True),
        "email.send": Limit(concurrency=3)})
    monitor._count([("webhook.post", "a", 2, ["w1", "w2"]), ("webhook.post", "b", 1, ["w3"]),
                    ("email.send", "a", 2, ["e1", "e2"]), ("email.send", "", 1, ["e3"])])
    assert monitor.most_running == {"webhook.post": 2, "email.send": 3}
    assert monitor.over == [] and monitor.over_samples == 0
    monitor._count([("webhook.post", "", 3, ["w4", "w5", "w6"]),
                    ("email.send", "a", 2, ["e1", "e2"]), ("email.send", "b", 2, ["e4", "e5"])])
    assert monitor.over_samples == 1
    assert monitor.over == [
        "webhook.post group '': 3 running at once, limit 2: w4, w5, w6",
        "email.send in all: 4 running at once, limit 3: e1, e2, e4, e5"]
