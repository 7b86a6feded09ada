"""The chaos runner's pure parts: the seeded plan and schedule, fault parsing, verdicts."""

from __future__ import annotations

import random
from collections import Counter

import click
import pytest

import effects.chaos
from effects.chaos import ChaosConfig, parse_faults
from effects.chaos.config import FAULT_KINDS, PROCESS_FAULTS
from effects.chaos.runner import missing_faults
from effects.chaos.schedule import KILL_WINDOWS, build_schedule, plan_jobs


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
