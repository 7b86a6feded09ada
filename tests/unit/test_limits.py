"""Limit and Throttled: what they accept and refuse, and the command-line form."""

from __future__ import annotations

import pytest

import outbox
from effects._http import provider_rate, throttled
from outbox.limits import parse_limit


@pytest.mark.parametrize(("text", "expected"), [
    ("2/s", outbox.Limit(rate=2.0)),
    ("120/m", outbox.Limit(rate=2.0)),
    ("3600/h,burst=4", outbox.Limit(rate=1.0, burst=4.0)),
    ("concurrency=4", outbox.Limit(concurrency=4)),
    ("10/s, burst=5, concurrency=3", outbox.Limit(rate=10.0, burst=5.0, concurrency=3)),
])
def test_parse_limit_reads_the_command_line_form(text: str, expected: outbox.Limit) -> None:
    assert parse_limit(text) == expected


@pytest.mark.parametrize(("text", "message"), [
    ("", "empty part"),
    ("fast", "cannot read 'fast'"),
    ("2/s,speed=3", "unknown limit part 'speed'"),
    ("concurrency=many", "concurrency in limit"),
    ("0/s", "positive"),
    ("burst=3", "needs a rate"),
])
def test_parse_limit_says_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_limit(text)


@pytest.mark.parametrize("kwargs", [
    {}, {"rate": 0}, {"rate": float("nan")}, {"rate": True}, {"concurrency": 0},
    {"concurrency": 1.5}, {"rate": 1, "burst": 0.5},
])
def test_limit_refuses_what_cannot_be_a_budget(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        outbox.Limit(**kwargs)  # type: ignore[arg-type]


def test_throttled_refuses_bad_delays_and_rates() -> None:
    assert outbox.Throttled(after=2).after == 2.0
    assert outbox.Throttled(2.5).after == 2.5  # after first, as the contract names it
    assert outbox.Throttled().after is None and outbox.Throttled(reason="429").reason == "429"
    with pytest.raises(ValueError):
        outbox.Throttled(after=-1)
    with pytest.raises(ValueError):
        outbox.Throttled(rate=0)


def test_provider_rate_reads_ratelimit_headers() -> None:
    assert provider_rate({"ratelimit-limit": "2"}) == 2.0
    assert provider_rate({"ratelimit-limit": "100", "ratelimit-policy": "100;w=60"}) == 100 / 60
    assert provider_rate({"ratelimit-limit": "lots"}) is None
    assert provider_rate({}) is None


def test_only_load_refusals_are_throttles() -> None:
    assert isinstance(throttled(429, {}, "r"), outbox.Throttled)
    assert isinstance(throttled(503, {"retry-after": "3"}, "r"), outbox.Throttled)
    assert throttled(503, {}, "r") is None
    assert throttled(500, {"retry-after": "3"}, "r") is None
