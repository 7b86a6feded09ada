"""``add_limits``: limits added to a dispatcher already built (what ``outbox run --limit``
does), on both flavours: replacing an effect's limit whole, checked as ``limits=`` is,
refused during a run, and in force in the next run."""

from __future__ import annotations

import asyncio
import threading

import pytest

import outbox

from .support import enqueue, limit_row, status_counts, wait_until


class Noop(outbox.Effect):
    """Succeeds at once."""

    def __init__(self, name: str, limit: outbox.Limit | None = None) -> None:
        self.name = name  # type: ignore[misc]
        self.limit = limit

    def perform(self, job: outbox.Job) -> None:
        return None


FLAVOURS = [outbox.Dispatcher, outbox.AsyncDispatcher]


def build(kind: type[outbox.Dispatcher | outbox.AsyncDispatcher], dsn: str,
          schema: str) -> outbox.Dispatcher | outbox.AsyncDispatcher:
    """A dispatcher with a limit of its own (email), one declared by an effect (charge),
    and an effect without one (webhook)."""
    return kind(dsn, [Noop("email.send"), Noop("payment.charge", outbox.Limit(rate=5.0)),
                      Noop("webhook.post")],
                schema=schema, limits={"email.send": outbox.Limit(rate=2.0, burst=4.0)})


@pytest.mark.parametrize("kind", FLAVOURS)
def test_an_added_limit_replaces_the_effects_limit_whole_and_keeps_the_others(
        dsn: str, schema: str, kind: type[outbox.Dispatcher | outbox.AsyncDispatcher]) -> None:
    dispatcher = build(kind, dsn, schema)
    dispatcher.add_limits({"email.send": outbox.Limit(concurrency=3),
                           "webhook.post": outbox.Limit(rate=9.0)})
    assert dispatcher.settings.limits == {
        "email.send": outbox.Limit(concurrency=3),  # not merged with rate=2, burst=4
        "payment.charge": outbox.Limit(rate=5.0),
        "webhook.post": outbox.Limit(rate=9.0),
    }


@pytest.mark.parametrize("kind", FLAVOURS)
@pytest.mark.parametrize(("added", "refusal"), [
    ({"sms.send": outbox.Limit(rate=1.0)}, "'sms.send', which this dispatcher does not run"),
    ({"email.send": 3}, r"limits\['email.send'\] must be an outbox.Limit, got 3"),
    ([("email.send", outbox.Limit(rate=1.0))], "limits must be a dict"),
])
def test_a_bad_limit_is_refused_as_limits_would_be_and_changes_nothing(
        dsn: str, schema: str, kind: type[outbox.Dispatcher | outbox.AsyncDispatcher],
        added: object, refusal: str) -> None:
    dispatcher = build(kind, dsn, schema)
    before = dispatcher.settings.limits
    with pytest.raises(outbox.ConfigurationError, match=refusal):
        dispatcher.add_limits(added)  # type: ignore[arg-type]
    assert dispatcher.settings.limits == before


def test_a_running_dispatcher_refuses_limits(dsn: str, schema: str) -> None:
    dispatcher = outbox.Dispatcher(dsn, [Noop("email.send")], schema=schema)
    runner = threading.Thread(target=dispatcher.run)
    runner.start()
    try:
        wait_until(lambda: dispatcher._running, "the dispatcher running")
        with pytest.raises(outbox.ConfigurationError, match="before the dispatcher runs"):
            dispatcher.add_limits({"email.send": outbox.Limit(rate=1.0)})
    finally:
        dispatcher.stop()
        runner.join()
    assert dispatcher.settings.limits == {}

    async_dispatcher = outbox.AsyncDispatcher(dsn, [Noop("email.send")], schema=schema)

    async def while_running() -> None:
        async with async_dispatcher:
            with pytest.raises(outbox.ConfigurationError, match="before the dispatcher runs"):
                async_dispatcher.add_limits({"email.send": outbox.Limit(rate=1.0)})

    asyncio.run(while_running())
    assert async_dispatcher.settings.limits == {}


@pytest.mark.parametrize("kind", FLAVOURS)
def test_an_added_limit_is_the_one_the_next_run_declares(
        dsn: str, schema: str, kind: type[outbox.Dispatcher | outbox.AsyncDispatcher]) -> None:
    dispatcher = kind(dsn, [Noop("email.send")], schema=schema,
                      limits={"email.send": outbox.Limit(rate=2.0)})
    dispatcher.add_limits({"email.send": outbox.Limit(rate=50.0, concurrency=4)})
    enqueue(dsn, schema, "email.send", ["a", "b", "c"])
    if isinstance(dispatcher, outbox.AsyncDispatcher):
        asyncio.run(dispatcher.run_until_idle(timeout=60))
    else:
        dispatcher.run_until_idle(timeout=60)
    assert status_counts(dsn, schema) == {"done": 3}
    declared = limit_row(dsn, schema, "email.send")
    assert declared is not None
    assert (declared["rate"], declared["concurrency"]) == (50.0, 4)
