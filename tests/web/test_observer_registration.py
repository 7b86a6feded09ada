"""Labelled series exist from the start, at 0 for every effect and outcome a dispatcher
runs (so ``rate()`` and ``increase()`` see its first failures), and observers are added
through the public ``add_observer``."""

from __future__ import annotations

import asyncio

import psycopg
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import outbox
from outbox.metrics import OUTCOMES, PrometheusObserver
from outbox.observe import DispatchObserver, MultiObserver

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


class Fails(outbox.Effect):
    name = "test.fails"

    def perform(self, job: outbox.Job) -> None:
        raise outbox.Permanent("no")


class Works(outbox.Effect):
    name = "test.works"

    def perform(self, job: outbox.Job) -> None:
        return None


def scrape(registry: CollectorRegistry) -> Samples:
    found = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            found[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return found


def assert_all_at_zero(got: Samples, effects: list[str]) -> None:
    for effect in effects:
        for outcome in OUTCOMES:
            labels = (("effect", effect), ("outcome", outcome))
            assert got[("outbox_job_attempts_total", labels)] == 0
            assert got[("outbox_job_attempt_duration_seconds_count", labels)] == 0
        assert got[("outbox_job_queue_wait_seconds_count", (("effect", effect),))] == 0
        assert got[("outbox_fence_rejections_total", (("effect", effect),))] == 0
        assert got[("outbox_jobs_in_flight", (("effect", effect),))] == 0


def test_every_series_starts_at_zero_before_the_first_event(dsn: str, schema: str) -> None:
    registry = CollectorRegistry()
    outbox.Dispatcher(dsn, [Works(), Fails()], schema=schema,
                      observer=PrometheusObserver(registry))
    assert_all_at_zero(scrape(registry), ["test.fails", "test.works"])


def test_the_first_failure_is_an_increase_from_zero(dsn: str, schema: str) -> None:
    registry = CollectorRegistry()
    dispatcher = outbox.Dispatcher(dsn, [Fails()], schema=schema,
                                   observer=PrometheusObserver(registry))
    before = scrape(registry)
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue("test.fails", key="f1", payload={})
    dispatcher.run_until_idle(timeout=60)
    after = scrape(registry)
    failed = ("outbox_job_attempts_total", (("effect", "test.fails"), ("outcome", "failed")))
    assert (before[failed], after[failed]) == (0, 1)


@pytest.mark.parametrize("flavour", ["threads", "async"])
def test_add_observer_adds_beside_the_existing_ones_once(
        dsn: str, schema: str, flavour: str) -> None:
    class Mine(DispatchObserver):
        pass

    mine = Mine()
    kind = outbox.Dispatcher if flavour == "threads" else outbox.AsyncDispatcher
    dispatcher = kind(dsn, [Works()], schema=schema, observer=mine)
    registry = CollectorRegistry()
    metrics = PrometheusObserver(registry)
    dispatcher.add_observer(metrics)
    dispatcher.add_observer(metrics)  # already there: nothing changes
    observer = dispatcher.settings.observer
    assert isinstance(observer, MultiObserver) and observer.observers == (mine, metrics)
    assert_all_at_zero(scrape(registry), ["test.works"])
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue("test.works", key="w1", payload={})
    if isinstance(dispatcher, outbox.Dispatcher):
        dispatcher.run_until_idle(timeout=60)
    else:
        asyncio.run(dispatcher.run_until_idle(timeout=60))
    done = ("outbox_job_attempts_total", (("effect", "test.works"), ("outcome", "done")))
    assert scrape(registry)[done] == 1


def test_add_observer_refuses_what_is_not_an_observer_and_a_running_dispatcher(
        dsn: str, schema: str) -> None:
    dispatcher = outbox.AsyncDispatcher(dsn, [Works()], schema=schema)
    with pytest.raises(outbox.ConfigurationError, match="DispatchObserver"):
        dispatcher.add_observer(object())  # type: ignore[arg-type]

    async def while_running() -> None:
        async with dispatcher:
            with pytest.raises(outbox.ConfigurationError, match="before the dispatcher runs"):
                dispatcher.add_observer(DispatchObserver())

    asyncio.run(while_running())
