"""The ``failover`` fault of the chaos runner: a primary and its asynchronous streaming
standby, the primary killed for good mid-run and the standby promoted, the dispatchers
on a multi-host DSN with ``wait_for_replicas=True``.

The run passes (its standby's WAL sender stopped 3 s before the kill, so orders are
lost): a failover happened (the checks read the promoted standby, out of recovery), no
effect was performed for an order the new primary lacks (phantoms 0), no job is stuck,
every job on the new primary was performed once; the acknowledged orders the failover
lost are counted, not flagged. The check can fail: the same run without
``wait_for_replicas`` performs the lost orders' effects before the primary dies, and
fails with that many phantoms, nothing else. On crafted rows: an effect performed for
a job the database lacks is a phantom; an order acknowledged and missing is a lost
order only after a failover (a violation otherwise); a handling lost with the old
primary is counted after a failover, a key handled twice is flagged still.
"""

from __future__ import annotations

import io
import os
from types import SimpleNamespace
from typing import Any

import pytest
from click.testing import CliRunner
from rich.console import Console

from effects.chaos import ChaosConfig, ChaosReport, command, parse_faults, run_chaos
from effects.chaos.checks import Findings, _check_events, _check_intent, _check_phantoms
from effects.chaos.schedule import Batch, JobPlan, PlannedJob

SEED = int(os.environ.get("OUTBOX_CHAOS_SEED", "20240601"))


def _explain(report: ChaosReport) -> str:
    buffer = io.StringIO()
    report.print(Console(file=buffer, width=140))
    return f"seed {report.seed} (OUTBOX_CHAOS_SEED={report.seed} replays it)\n{buffer.getvalue()}"


def _run(wait_for_replicas: bool, lag: float = 3.0) -> ChaosReport:
    """A short run with kills and a failover whose standby lags ``lag`` seconds behind
    when the primary dies (its WAL sender stopped): the orders of those seconds are lost."""
    return run_chaos(ChaosConfig(workers=2, jobs=300, duration=12.0, deadline=120.0,
                                 seed=SEED, faults=parse_faults("failover,kill"),
                                 failover_lag=lag, wait_for_replicas=wait_for_replicas))


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_failover_performs_nothing_for_lost_orders_and_leaves_no_job_stuck() -> None:
    report = _run(wait_for_replicas=True)
    assert report.ok, _explain(report)
    assert report.faults["failover"] == {"armed": 1, "injected": 1}, _explain(report)
    failover = report.failover
    assert failover["lost_orders"] > 0, _explain(report)  # the standby did lag
    assert (failover["old_primary"], failover["new_primary"]) == ("primary", "standby")
    assert failover["checked_on"] == "standby", _explain(report)  # promoted, writable
    assert failover["phantoms"] == report.violation_counts["phantoms"] == 0
    assert report.jobs["lost"] == 0
    # Every job the new primary holds ended; those of the orders it lost are all it lacks.
    assert report.jobs["committed"] == report.jobs["planned"] - failover["lost_order_jobs"]
    assert report.jobs["done"] + report.jobs["failed"] + report.jobs["reconcile"] == \
        report.jobs["committed"]
    assert "standby" in report.database


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_without_wait_for_replicas_the_effects_of_lost_orders_are_phantoms() -> None:
    # A longer lag than the run above: the dispatchers must reach a lost order's job
    # before the primary dies, which on a machine loaded by other work may take more
    # than 3 s (one such run performed none of them).
    report = _run(wait_for_replicas=False, lag=6.0)
    failover = report.failover
    assert failover["checked_on"] == "standby", _explain(report)
    assert failover["lost_orders"] > 0, _explain(report)
    # Performed during the lag, before the primary died: each a phantom, and the run fails.
    assert 0 < failover["phantoms"] == report.violation_counts["phantoms"], _explain(report)
    assert failover["phantoms"] <= failover["lost_order_jobs"]
    assert not report.ok
    assert set(report.violations) == {"phantoms"}, _explain(report)


class _Fake:
    """A provider that performed the keys it was given, once each."""

    def __init__(self, keys: set[str]) -> None:
        self.keys = keys

    def performed(self, key: str) -> int:
        return int(key in self.keys)

    def performed_keys(self) -> list[str]:
        return sorted(self.keys)


def _plan() -> JobPlan:
    def job(key: str) -> PlannedJob:
        return PlannedJob(key, "email.send", {})

    return JobPlan(bulk=(Batch("kept", 0.0, 0, (job("k-1"), job("k-2"))),),
                   trickle=(Batch("lost", 1.0, 0, (job("l-1"),)),
                            Batch("lost-too", 2.0, 0, (job("l-2"),))))


def _intent(failed_over: bool, performed: set[str]) -> Findings:
    """The checks of intent and phantoms on a database that holds the order ``kept``
    and its jobs, whereas ``lost`` and ``lost-too`` were acknowledged too."""
    findings = Findings(failed_over=failed_over)
    providers: Any = SimpleNamespace(for_effect=lambda effect: _Fake(performed))
    rows: Any = {"k-1": object(), "k-2": object()}
    _check_intent(findings, _plan(), {"kept", "lost", "lost-too"}, rows, {"kept"}, providers)
    _check_phantoms(findings, _plan(), rows, providers)
    return findings


def test_an_effect_performed_for_a_job_the_new_primary_lacks_is_a_phantom() -> None:
    findings = _intent(failed_over=True, performed={"k-1", "k-2", "l-2"})
    assert findings.counts["phantoms"] == 1
    assert findings.violations["phantoms"] == [
        "l-2: performed 1x, no such job in the database"]
    assert findings.failover["phantoms"] == 1
    assert findings.failover["lost_orders"] == 2
    assert findings.failover["lost_order_jobs"] == 2
    assert findings.counts["missing_jobs"] == findings.counts["orders_mismatch"] == 0


def test_orders_lost_by_a_failover_are_counted_not_flagged_and_only_after_one() -> None:
    after = _intent(failed_over=True, performed={"k-1", "k-2"})
    assert sum(after.counts.values()) == 0
    assert after.failover["lost_orders"] == 2
    assert after.failover["lost_order_examples"] == ["lost", "lost-too"]
    without = _intent(failed_over=False, performed={"k-1", "k-2"})
    assert without.counts["missing_jobs"] == 2
    assert without.counts["orders_mismatch"] == 2
    assert without.failover == {}


def test_failover_is_chosen_by_name_only_and_needs_a_server_of_the_runs_own() -> None:
    assert "failover" not in parse_faults("all")
    assert "failover" not in ChaosConfig().faults
    assert parse_faults("failover,kill") == {"failover", "kill"}
    with pytest.raises(ValueError, match="not with --dsn"):
        ChaosConfig(faults=frozenset({"failover"}), dsn="host=db")
    with pytest.raises(ValueError, match="one target"):
        ChaosConfig(faults=frozenset({"failover"}), targets=2)
    with pytest.raises(ValueError, match="failover lag"):
        ChaosConfig(faults=frozenset({"failover"}), duration=4.0, failover_lag=3.0)
    result = CliRunner().invoke(command, ["--faults", "failover,bogus"])
    assert result.exit_code == 2
    assert "failover" in result.output  # named among the kinds to choose from


def _events(failed_over: bool, consumed: dict[str, int]) -> Findings:
    """The NATS checks on a stream holding one message for each of a, b and c."""
    broker = SimpleNamespace(messages_per_key=lambda: {"a": 1, "b": 1, "c": 1},
                             dead_letters=lambda: 0, consumer_stats={}, restart_seconds=[])
    findings = Findings(failed_over=failed_over)
    _check_events(findings, SimpleNamespace(broker=broker), consumed)  # type: ignore[arg-type]
    return findings


def test_a_handling_lost_by_a_failover_is_counted_and_one_twice_still_flagged() -> None:
    after = _events(failed_over=True, consumed={"a": 1, "c": 2})
    assert after.failover["handlings_lost"] == 1  # b: its inbox row lost with the primary
    assert after.violations["consumed_not_once"] == ["c: stored, handled 2x by the consumer"]
    without = _events(failed_over=False, consumed={"a": 1, "c": 2})
    assert without.counts["consumed_not_once"] == 2
    assert without.failover == {}
