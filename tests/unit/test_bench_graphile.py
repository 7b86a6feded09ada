"""The graphile benchmark's Python side of its Node driver (``benchmarks/_graphile.py``):
the settings it hands over are the ones ``drain.js`` reads, and what the driver prints is
read strictly, so a run that did not apply its settings or left jobs undone is an error,
never a figure."""

from __future__ import annotations

import json
import re
from dataclasses import asdict

import pytest

from benchmarks._graphile import (
    DRIVER,
    PEER,
    TUNED,
    UNTUNED,
    VERSION,
    GraphileError,
    GraphileSettings,
    check_drain,
    environment,
    parse_report,
)


def _done(**changes: object) -> dict[str, object]:
    report: dict[str, object] = {"done": True, "jobs": 100, "performed": 100, "distinct": 100,
                                 "seconds": 0.5, "cpu_seconds": 0.2, "fetches": 1,
                                 "largest_fetch": 100}
    report.update(changes)
    return report


def test_every_setting_handed_over_is_read_by_the_driver_and_none_else() -> None:
    # The harness this replaces gave the local queue and the batch delays where Graphile
    # Worker does not read them: here each key we send is one drain.js reads, and back.
    read = set(re.findall(r"settings\.(\w+)", DRIVER.read_text("utf-8")))
    assert read == set(asdict(TUNED))
    assert set(json.loads(TUNED.as_json())) == read


def test_the_driver_pins_the_version_the_section_names() -> None:
    package = json.loads((PEER / "package.json").read_text("utf-8"))
    lock = json.loads((PEER / "package-lock.json").read_text("utf-8"))
    assert package["dependencies"]["graphile-worker"] == VERSION
    assert lock["packages"]["node_modules/graphile-worker"]["version"] == VERSION


def test_tuned_and_untuned_differ_in_the_throughput_settings_only() -> None:
    assert TUNED.local_queue > 0 and TUNED.complete_batch_delay >= 0
    assert UNTUNED.local_queue == -1 and UNTUNED.complete_batch_delay == -1
    assert (TUNED.concurrency, TUNED.pool) == (UNTUNED.concurrency, UNTUNED.pool)


def test_a_report_line_is_read_as_its_json_object() -> None:
    assert parse_report(b'{"ready": true}\n', "ready") == {"ready": True}
    assert parse_report(json.dumps(_done()), "done")["performed"] == 100


@pytest.mark.parametrize(("line", "says"), [
    (b"", "got nothing"),
    (b"Error: connect ECONNREFUSED", "expected a JSON 'done' report"),
    (b'{"ready": true}', "expected a 'done' report"),
    (b"[1, 2]", "expected a 'done' report"),
])
def test_a_line_that_is_not_the_report_expected_says_what_it_was(line: bytes,
                                                                 says: str) -> None:
    with pytest.raises(GraphileError, match=re.escape(says)):
        parse_report(line, "done")


def test_a_complete_drain_passes_its_check() -> None:
    check_drain(_done(), 100, TUNED)
    check_drain(_done(fetches=0), 100, UNTUNED)  # no local queue: no fetch expected


def test_a_drain_that_performed_fewer_jobs_is_an_error() -> None:
    with pytest.raises(GraphileError, match="performed 99 jobs, expected 100"):
        check_drain(_done(performed=99), 100, TUNED)


def test_a_drain_that_performed_a_job_twice_is_an_error() -> None:
    with pytest.raises(GraphileError, match="performed 99 distinct jobs of 100: some more"):
        check_drain(_done(distinct=99), 100, TUNED)


def test_a_local_queue_that_never_fetched_means_the_settings_were_not_applied() -> None:
    with pytest.raises(GraphileError, match="did not reach the worker"):
        check_drain(_done(fetches=0), 100, TUNED)


def test_a_report_missing_a_figure_is_an_error() -> None:
    report = _done()
    del report["cpu_seconds"]
    with pytest.raises(GraphileError, match="'cpu_seconds' missing"):
        check_drain(report, 100, TUNED)


def test_settings_are_checked_at_construction() -> None:
    with pytest.raises(ValueError, match="local_queue must be -1 .off. or at least 1, got 0"):
        GraphileSettings(local_queue=0)
    with pytest.raises(ValueError, match="concurrency and pool must be at least 1"):
        GraphileSettings(pool=0)


def test_an_unknown_setting_is_named_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown setting\(s\) localQueue; known: .*local_queue"):
        TUNED.with_options([("localQueue", 500)])
    assert TUNED.with_options([("local_queue", 500)]).local_queue == 500


def test_the_driver_gets_the_database_as_pg_variables_and_nothing_inherited(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGSERVICE", "elsewhere")
    env = environment("host=/tmp/sock port=5433 user=bench dbname=bench_graphile_1",
                      PEER / "node_modules")
    assert (env["PGHOST"], env["PGPORT"], env["PGUSER"], env["PGDATABASE"]) == (
        "/tmp/sock", "5433", "bench", "bench_graphile_1")
    assert "PGSERVICE" not in env and "PGPASSWORD" not in env
    assert env["NODE_PATH"] == str(PEER / "node_modules")
