"""Validation and canonical form of enqueue requests, without a database."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from types import MappingProxyType
from typing import Any

import pytest
from pydantic import BaseModel

from outbox import IdempotencyKeyConflict, InvalidKey, InvalidPayload
from outbox._enqueue import canonical_json, dedupe_batch, fingerprint, notify_channel, prepare


def test_canonical_json_ignores_key_order() -> None:
    assert canonical_json({"b": 1, "a": [1, 2]}) == canonical_json({"a": [1, 2], "b": 1})
    assert canonical_json({"b": 1, "a": 2}) == '{"a":2,"b":1}'


def test_fingerprint_depends_on_effect_and_payload() -> None:
    body = canonical_json({"a": 1})
    assert fingerprint("email.send", body) != fingerprint("webhook.post", body)
    assert fingerprint("email.send", body) != fingerprint("email.send", canonical_json({"a": 2}))


class Order(BaseModel):
    order_id: int
    email: str


def test_pydantic_models_are_payloads() -> None:
    job = prepare("email.send", "email-order-1", Order(order_id=1, email="a@example.com"))
    assert job.payload_json == '{"email":"a@example.com","order_id":1}'


def test_any_mapping_and_a_model_inside_encode_as_their_dicts() -> None:
    inner = MappingProxyType({"b": 1, "a": [MappingProxyType({"z": None})]})
    payload = MappingProxyType({"inner": inner, "order": Order(order_id=1, email="a@x")})
    as_dict = {"inner": {"a": [{"z": None}], "b": 1},
               "order": {"email": "a@x", "order_id": 1}}
    assert canonical_json(payload) == canonical_json(as_dict)
    assert prepare("e", "k", payload).fingerprint == prepare("e", "k", as_dict).fingerprint


@pytest.mark.parametrize(("key", "message"), [
    ("", "must not be empty"),
    ("k" * 256, "256 characters long; at most 255"),
    ("email\norder", "not printable ASCII ('\\n') at position 5"),
    ("caf\u00e9", "not printable ASCII ('\u00e9') at position 3"),
    ("tab\there", "position 3"),
])
def test_bad_keys_are_refused_with_the_reason(key: str, message: str) -> None:
    with pytest.raises(InvalidKey, match="key") as info:
        prepare("email.send", key, {})
    assert message in str(info.value)


def test_non_string_key_is_refused() -> None:
    with pytest.raises(InvalidKey, match="must be a string, got int"):
        prepare("email.send", 5, {})  # type: ignore[arg-type]


def test_longest_key_is_accepted() -> None:
    assert prepare("e", "k" * 255, {}).key == "k" * 255


@pytest.mark.parametrize(("payload", "message"), [
    ({"amount": float("nan")}, "not valid JSON"),
    ({"amount": float("inf")}, "not valid JSON"),
    ({"when": datetime.now()}, "holds a datetime, which is not JSON-serialisable"),
    ({"s": {1, 2}}, "holds a set"),
    ({"text": "a\x00b"}, "NUL character"),
    ([1, 2], "must be a mapping or a pydantic model, got list"),
    ("text", "got str"),
    ({"blob": "x" * 1_000_001}, "at most 1000000 are allowed"),
])
def test_bad_payloads_are_refused_with_the_reason(payload: Any, message: str) -> None:
    with pytest.raises(InvalidPayload) as info:
        prepare("email.send", "k", payload)
    assert message in str(info.value)


def test_deeply_nested_payload_is_refused() -> None:
    payload: dict[str, Any] = {}
    inner = payload
    for _ in range(100_000):
        inner["x"] = {}
        inner = inner["x"]
    with pytest.raises(InvalidPayload, match="nested too deeply"):
        prepare("e", "k", payload)


def test_circular_payload_is_refused() -> None:
    payload: dict[str, Any] = {}
    payload["self"] = payload
    with pytest.raises(InvalidPayload):
        prepare("e", "k", payload)


def test_empty_effect_is_refused() -> None:
    with pytest.raises(InvalidPayload, match="effect must be a non-empty string"):
        prepare(" ", "k", {})


@pytest.mark.parametrize("max_attempts", [0, -1, True, 2.5])
def test_bad_max_attempts_is_refused(max_attempts: Any) -> None:
    with pytest.raises(InvalidPayload, match="max_attempts must be a positive integer"):
        prepare("e", "k", {}, max_attempts=max_attempts)


def test_run_at_must_be_aware() -> None:
    with pytest.raises(InvalidPayload, match="timezone-aware"):
        prepare("e", "k", {}, run_at=datetime(2030, 1, 1))


def test_run_at_accepts_a_delay() -> None:
    job = prepare("e", "k", {}, run_at=timedelta(minutes=5))
    assert job.run_at is not None
    assert job.run_at > datetime.now(UTC) + timedelta(minutes=4)


def test_batch_dedupe_keeps_first_and_refuses_conflicts() -> None:
    a = prepare("e", "k1", {"x": 1})
    again = prepare("e", "k1", {"x": 1})
    b = prepare("e", "k2", {})
    assert dedupe_batch([a, b, again]) == [a, b]
    with pytest.raises(IdempotencyKeyConflict, match="'k1'"):
        dedupe_batch([a, prepare("e", "k1", {"x": 2})])


def test_notify_channel_is_a_short_identifier_for_any_schema() -> None:
    channel = notify_channel('we"ird; DROP TABLE x' * 3)
    assert channel.startswith("outbox_") and len(channel) < 63 and channel.isidentifier()
