"""The dispatchers' options are declared once (``outbox._dispatch.options.OPTIONS``) and
every reader takes them from there: these tests fail when the constructors, the checked
settings, the attributes, the fleet's engines, the reference or ``outbox run`` leave an
option out or disagree on its default."""

from __future__ import annotations

import dataclasses
import inspect
import re
from datetime import timedelta
from typing import Any

import click
import pytest

import outbox
from outbox import AsyncDispatcher, Backoff, Dispatcher, Effect, Job, Limit, Schedule, Target
from outbox._dispatch.options import (
    CLI_FLAGS,
    ENGINE_OPTIONS,
    OPTIONS,
    PUBLIC_OPTIONS,
    SETTINGS_OPTIONS,
)
from outbox._dispatch.settings import Settings
from outbox.cli import main
from outbox.dispatcher import _Options
from outbox.observe import DispatchObserver

NAMES = [option.name for option in OPTIONS]
# ``outbox run``'s flags about the process, not about a dispatcher's options.
PROCESS_FLAGS = {"--dsn", "--metrics-port", "--metrics-host", "--wait-for-database", "--help"}


class Send(Effect):
    name = "options.send"

    def perform(self, job: Job) -> None:
        return None


class Other(Effect):
    name = "options.other"

    def perform(self, job: Job) -> None:
        return None


def _hook(*args: object) -> None:
    return None


def _parameters(function: Any) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(function).parameters.values()
            if p.name not in ("self", "cls")]


@pytest.mark.parametrize("cls", [Dispatcher, AsyncDispatcher])
def test_the_constructors_take_every_option_in_order_with_its_default(cls: type) -> None:
    parameters = _parameters(cls.__init__)  # type: ignore[misc]
    assert [p.name for p in parameters] == NAMES
    for parameter, option in zip(parameters, OPTIONS, strict=True):
        assert parameter.default == option.default, option.name


def test_settings_build_checks_every_settings_option_with_the_same_default() -> None:
    parameters = {p.name: p for p in _parameters(Settings.build)}
    assert list(parameters) == ["conninfo", "effects", *SETTINGS_OPTIONS]
    by_name = {option.name: option for option in OPTIONS}
    for name in SETTINGS_OPTIONS:
        assert parameters[name].default == by_name[name].default, name


def test_every_public_option_is_a_typed_attribute_holding_the_checked_value() -> None:
    annotations = _Options.__annotations__
    assert set(PUBLIC_OPTIONS) <= set(annotations)
    dispatcher = Dispatcher("dbname=unused", [Send()], lease=timedelta(seconds=90))
    for name in PUBLIC_OPTIONS:
        assert getattr(dispatcher, name) == getattr(dispatcher.settings, name), name
    assert dispatcher.lease == 90.0 and dispatcher.rescue_interval == 5.0


def test_the_reference_has_a_parameter_line_for_each_option_in_order() -> None:
    doc = Dispatcher.__init__.__doc__ or ""
    assert re.findall(r":param (\w+):", doc) == NAMES
    for option in OPTIONS:
        line = re.split(r":param |:raises ", doc.split(f":param {option.name}: ", 1)[1])[0]
        assert " ".join(line.split()) == " ".join(option.reference().split()), option.name
        assert option.doc and (not option.unit or f"({option.unit})" in " ".join(line.split()))


# A value other than the default for each option a fleet's dispatcher takes, so that an
# engine that missed one shows it. A new option must be added here (or to FLEET_ONLY /
# NOT_WITH_TARGETS, saying why): the first assertion below fails until it is.
NOT_DEFAULT: dict[str, Any] = {
    "effects": [Send(), Other()],
    "concurrency": 3, "lease": 40, "batch_size": 7, "prefetch": 9, "max_prefetch": 11,
    "poll_interval": 0.7, "rescue_interval": 2, "backoff": Backoff(base=2, cap=20),
    "unknown_outcome_window": 600, "retention": 60, "ledger_retention": 120,
    "inbox_retention": 30, "worker_id": "fleet-options", "observer": DispatchObserver(),
    "metrics": True, "on_done": {Send.name: _hook}, "on_failed": {Send.name: _hook},
    "reconcile_interval": 3, "limits": {Other.name: Limit(rate=5)},
    "breaker_threshold": 2, "stop_timeout": 4, "limits_home": Target("dbname=home"),
    "schedules": [Schedule("tick", effect=Send.name, every=60)],
    "wait_for_replicas": True,
    "targets_interval": 5, "max_connections": 9, "quiet_look_interval": 12,
}
# the fleet's, not an engine's
FLEET_ONLY = {"targets", "targets_interval", "max_connections", "quiet_look_interval"}
NOT_WITH_TARGETS = {"conninfo", "listen_conninfo", "schema"}  # each target has its own


def test_each_engine_of_a_fleet_gets_every_option_of_its_dispatcher() -> None:
    assert set(NOT_DEFAULT) | FLEET_ONLY | NOT_WITH_TARGETS == set(NAMES)
    target = Target("dbname=tenant", "tenant_a")
    fleet = Dispatcher(targets=[target], **NOT_DEFAULT)
    engine = fleet._engine(target)
    assert type(engine) is Dispatcher and not engine.serves_targets
    assert (engine.settings.conninfo, engine.settings.schema) == ("dbname=tenant", "tenant_a")
    for f in dataclasses.fields(Settings):
        if f.name not in ("conninfo", "schema"):
            assert getattr(engine.settings, f.name) == getattr(fleet.settings, f.name), f.name
    assert engine.schedules == fleet.schedules
    assert set(ENGINE_OPTIONS) <= set(NOT_DEFAULT)
    assert fleet._fleet is not None
    assert fleet._fleet.targets_interval == 5.0
    assert fleet._fleet.schedule.max_connections == 9
    assert fleet._fleet.quiet_look_interval == 12.0


def test_a_dispatcher_made_for_targets_keeps_every_option() -> None:
    given = {k: v for k, v in NOT_DEFAULT.items() if k not in FLEET_ONLY}
    one = Dispatcher("dbname=one", **given)
    fleet = one._with_targets([Target("dbname=tenant")], max_connections=9)
    for f in dataclasses.fields(Settings):
        if f.name != "conninfo":
            assert getattr(fleet.settings, f.name) == getattr(one.settings, f.name), f.name


def test_every_flag_of_outbox_run_names_an_option_or_the_process() -> None:
    run = main.commands["run"]
    assert isinstance(run, click.Command)
    flags = {opt for param in run.params if isinstance(param, click.Option)
             for opt in param.opts}
    assert flags - PROCESS_FLAGS == set(CLI_FLAGS)
    assert set(CLI_FLAGS.values()) <= set(NAMES)
    # A flag with a default of its own has the option's (None: the dispatcher's own).
    by_name = {option.name: option for option in OPTIONS}
    for param in run.params:
        for flag in getattr(param, "opts", []):
            if flag in CLI_FLAGS and isinstance(param.default, int | float | str):
                assert param.default == by_name[CLI_FLAGS[flag]].default, flag


def test_an_option_set_after_construction_is_checked_and_reaches_every_reader() -> None:
    target = Target("dbname=tenant")
    dispatcher = Dispatcher(targets=[target], effects=[Send()])
    dispatcher._set_options(stop_timeout=timedelta(seconds=7), wait_for_replicas=True)
    assert dispatcher.settings.stop_timeout == dispatcher.stop_timeout == 7.0
    assert dispatcher.settings.wait_for_replicas is dispatcher.wait_for_replicas is True
    engine = dispatcher._engine(target)
    assert (engine.stop_timeout, engine.wait_for_replicas) == (7.0, True)
    with pytest.raises(outbox.ConfigurationError, match="lease must be at least 1.0 seconds"):
        dispatcher._set_options(lease=0.5)
    assert dispatcher.lease == 30.0  # a refused change changes nothing
    worker_id = dispatcher.worker_id
    dispatcher._set_options(lease=2)  # what is derived from it follows
    assert (dispatcher.lease, dispatcher.rescue_interval) == (2.0, 2.0)
    assert dispatcher.worker_id == worker_id and dispatcher.stop_timeout == 7.0
    with pytest.raises(outbox.ConfigurationError, match="targets_interval"):
        dispatcher._set_options(targets_interval=3)
