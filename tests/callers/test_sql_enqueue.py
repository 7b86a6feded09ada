"""``<schema>.enqueue`` (migration 0017) against ``tx.enqueue`` on real PostgreSQL: one
fingerprint, one dedup, one wake-up, the same refusals, and a role that may only enqueue."""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import outbox
from outbox import IdempotencyKeyConflict, InvalidArgument, InvalidKey, InvalidPayload
from outbox.errors import EnqueueError, UnknownEffect
from outbox.sql import canonical_json, enqueue_error, fingerprint, notify_channel
from outbox.testing import jobs

from .support import Recorder, sql_enqueue

# Strings a fingerprint must not get wrong: escapes, non-ASCII, astral characters, the
# characters JSON encoders disagree on (DEL, U+2028), and text that looks like a number.
STRINGS = ["", "a", "é", "naïve café", "日本語", "😀 emoji", "\u2028\u2029", "\x7f", "\x01\x1f",
           'quote " backslash \\ slash /', "tab\tnewline\nreturn\r", "\b\f", "1e5", "-0.0",
           "z", "Z", "ä", "a" * 300]
NUMBERS: list[Any] = [0, 1, -1, 2**31, 2**63, -(2**63) - 1, 10**30, 0.0, -0.0, 1.0, 0.1, 1.5,
                      -2.5, 1e15, 1e16, 1e17, 1.5e-7, 1e-4, 1e-5, 123456789.125, 3.141592653589793,
                      1.7976931348623157e308, 5e-324, -1e-300, 2.5e22, 100.0]


def _random_value(rng: random.Random, depth: int) -> Any:
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return rng.choice(STRINGS) + rng.choice(["", str(rng.random())])
    if kind == 1:
        return rng.choice(NUMBERS)
    if kind == 2:
        return rng.choice([True, False, None])
    if kind == 3:
        return rng.uniform(-1e6, 1e6) * 10 ** rng.randrange(-30, 30)
    if kind in (4, 5):
        return {rng.choice(STRINGS)[:8] + str(i): _random_value(rng, depth + 1)
                for i in range(rng.randrange(5))}
    return [_random_value(rng, depth + 1) for _ in range(rng.randrange(5))]


def payloads() -> list[dict[str, Any]]:
    """Hand-picked payloads and 400 random nested ones (seeded: the same every run)."""
    picked: list[dict[str, Any]] = [
        {}, {"a": 1}, {"b": 1, "a": 2, "aa": 3, "": 4, "B": 5, "é": 6, "😀": 7, "z": 8},
        {"numbers": NUMBERS}, {"strings": STRINGS}, {s: s for s in STRINGS},
        {"nested": {"deep": [{"x": [[], {}, [None, True, False]]}]}},
        {"amount": 1999, "currency": "eur", "meta": {"order": "102", "lines": [1, 2.5]}},
    ]
    rng = random.Random(44)
    return picked + [
        {f"k{i}": _random_value(rng, 0) for i in range(rng.randrange(1, 6))} for _ in range(400)]


def test_python_and_sql_take_one_fingerprint(schema: str, conn: psycopg.Connection[Any]) -> None:
    """The canonical JSON tx.enqueue sends, once stored as jsonb, gives back the same text
    and fingerprint in SQL: so a key sent by one caller is recognised by the other."""
    cases = [(effect, canonical_json(payload))
             for payload in payloads() for effect in ("email.send", "é.ünïcode")[:1]]
    cases.append(("é.ünïcode", canonical_json({"é": "ü"})))
    rows = conn.execute(
        sql.SQL("SELECT c.effect, {s}.canonical_json(CAST(c.payload AS jsonb)),"
                " {s}.fingerprint(c.effect, CAST(c.payload AS jsonb))"
                " FROM jsonb_to_recordset(%s) AS c(effect text, payload text)"
                ).format(s=sql.Identifier(schema)),
        (json.dumps([{"effect": e, "payload": p} for e, p in cases]),)).fetchall()
    assert len(rows) == len(cases) > 400
    for (effect, text), (_, sql_text, sql_print) in zip(cases, rows, strict=True):
        assert sql_text == text
        assert sql_print == fingerprint(effect, text)


def test_numbers_are_written_as_jsonb_prints_them() -> None:
    assert canonical_json({"a": 1e16, "b": 1.5e-7, "c": -0.0, "d": 1.0, "e": "1e16"}) == (
        '{"a":10000000000000000,"b":0.00000015,"c":0.0,"d":1.0,"e":"1e16"}')


def test_a_key_from_python_is_found_by_sql_and_back(dsn: str, schema: str) -> None:
    payload = {"to": "ada@example.com", "amount": 12.5, "big": 1e20, "name": "Zoë"}
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        first = tx.enqueue("email.send", key="from-python", payload=payload)
    with psycopg.connect(dsn) as conn:
        assert sql_enqueue(conn, schema, "email.send", "from-python", payload) == first.job_id
        made = sql_enqueue(conn, schema, "email.send", "from-sql", {"n": [1, 2.0, {"é": None}]})
        conn.commit()
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        again = tx.enqueue("email.send", key="from-sql", payload={"n": [1, 2.0, {"é": None}]})
        assert (again.job_id, again.created) == (made, False)
        with pytest.raises(IdempotencyKeyConflict, match="with a different payload"):
            tx.enqueue("email.send", key="from-sql", payload={"n": [1, 2.0]})
    assert set(jobs(dsn, schema)) == {"from-python", "from-sql"}


def _refusal(conn: psycopg.Connection[Any], schema: str, *args: Any,
             **named: Any) -> EnqueueError:
    with pytest.raises(psycopg.Error) as raised:
        sql_enqueue(conn, schema, *args, **named)
    conn.rollback()
    diag = raised.value.diag
    error = enqueue_error(diag.sqlstate, diag.message_primary or "", diag.message_detail)
    assert error is not None, f"{diag.sqlstate}: {diag.message_primary}"
    return error


def test_a_reused_key_with_another_request_is_the_same_conflict(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn) as conn:
        made = sql_enqueue(conn, schema, "email.send", "k-1", {"to": "a"})
        assert sql_enqueue(conn, schema, "email.send", "k-1", {"to": "a"}) == made
        conn.commit()
        other_payload = _refusal(conn, schema, "email.send", "k-1", {"to": "b"})
        other_effect = _refusal(conn, schema, "sms.send", "k-1", {"to": "a"})
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        with pytest.raises(IdempotencyKeyConflict) as python_payload:
            tx.enqueue("email.send", key="k-1", payload={"to": "b"})
        with pytest.raises(IdempotencyKeyConflict) as python_effect:
            tx.enqueue("sms.send", key="k-1", payload={"to": "a"})
    assert isinstance(other_payload, IdempotencyKeyConflict) and other_payload.key == "k-1"
    assert str(other_payload) == str(python_payload.value)
    assert isinstance(other_effect, IdempotencyKeyConflict)
    assert str(other_effect) == str(python_effect.value)
    assert list(jobs(dsn, schema)) == ["k-1"]


def test_a_key_only_the_ledger_remembers_returns_null(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn) as conn:
        sql_enqueue(conn, schema, "test.record", "done-once", {"n": 1})
        conn.commit()
    recorder = Recorder()
    outbox.Dispatcher(dsn, [recorder], schema=schema).run_until_idle(timeout=30)
    with psycopg.connect(dsn) as conn:  # as retention leaves it: the ledger row only
        conn.execute(sql.SQL("DELETE FROM {}.jobs").format(sql.Identifier(schema)))
        conn.commit()
        assert sql_enqueue(conn, schema, "test.record", "done-once", {"n": 1}) is None
        refused = _refusal(conn, schema, "test.record", "done-once", {"n": 2})
        conn.commit()
    assert isinstance(refused, IdempotencyKeyConflict)
    assert jobs(dsn, schema) == {}
    assert recorder.calls == {"done-once": 1}


def test_a_payload_python_cannot_read_fails_its_job_and_nothing_else(
        dsn: str, schema: str) -> None:
    # jsonb takes an integer of any length; Python's int none past 4,300 digits. Written
    # by SQL (or a trigger), such a job must go to failed with the reason, once, while
    # the jobs claimed with it are performed: not stop the dispatcher, not loop.
    with psycopg.connect(dsn) as conn:
        sql_enqueue(conn, schema, "test.record", "too-long", '{"n": 1e5000}')
        for i in range(3):
            sql_enqueue(conn, schema, "test.record", f"fine-{i}", {"n": i})
        conn.commit()
    recorder = Recorder()
    stats = outbox.Dispatcher(dsn, [recorder], schema=schema).run_until_idle(timeout=30)
    assert (stats.done, stats.failed) == (3, 1)
    assert recorder.calls == {f"fine-{i}": 1 for i in range(3)}
    with psycopg.connect(dsn) as conn:  # its payload as text: Python cannot read it
        row = conn.execute(sql.SQL(
            "SELECT id, status, attempts, last_error FROM {}.jobs WHERE key = 'too-long'")
            .format(sql.Identifier(schema))).fetchone()
    assert row is not None
    job_id, status, attempts, last_error = row
    assert (status, attempts) == ("failed", 1)
    assert last_error.startswith(
        f"Permanent: payload of job {job_id} cannot be read in Python (ValueError: ")
    assert "4300 digits" in last_error


@pytest.mark.parametrize(("args", "named", "kind", "words"), [
    (("email.send", "k", json.dumps([1, 2])), {}, InvalidPayload,
     "payload must be a JSON object, got a JSON array"),
    (("email.send", "k", json.dumps("text")), {}, InvalidPayload, "payload must be a JSON object"),
    (("email.send", "k", None), {}, InvalidPayload, "payload must be a JSON object, got NULL"),
    (("email.send", "k", json.dumps({"big": "x" * 1_000_001})), {}, InvalidPayload,
     "payload is 1000011 bytes as JSON"),
    (("email.send", "", {}), {}, InvalidKey, "key must not be empty"),
    (("email.send", None, {}), {}, InvalidKey, "key must not be empty"),
    (("email.send", "k" * 256, {}), {}, InvalidKey, "key is 256 characters long"),
    (("email.send", "cl\u00e9", {}), {}, InvalidKey,
     "key 'clé' has a character that is not printable ASCII (\"é\") at position 2"),
    (("email.send", "k", {}), {"ordering_key": "a\tb"}, InvalidKey, "ordering_key 'a\tb' has"),
    (("", "k", {}), {}, InvalidArgument, "effect must be a non-empty string"),
    (("email.send", "k", {}), {"max_attempts": 0}, InvalidArgument,
     "max_attempts must be a positive integer, got 0"),
    (("email.send", "k", {}), {"priority": 1001}, InvalidArgument, "priority is 1001"),
    (("email.send", "k", {}), {"group_key": ""}, InvalidArgument, "group_key must be 1 to 255"),
])
def test_bad_arguments_are_refused_naming_the_argument(
        schema: str, conn: psycopg.Connection[Any], args: tuple[Any, ...], named: dict[str, Any],
        kind: type[EnqueueError], words: str) -> None:
    error = _refusal(conn, schema, *args, **named)
    assert type(error) is kind
    assert words in str(error)
    assert jobs(conn, schema) == {}


def test_the_python_side_refuses_the_same(schema: str, conn: psycopg.Connection[Any]) -> None:
    """The same mistakes given to tx.enqueue raise the same error classes."""
    cases: list[tuple[str, str, Any, dict[str, Any], type[EnqueueError]]] = [
        ("email.send", "k", [1, 2], {}, InvalidPayload),
        ("email.send", "", {}, {}, InvalidKey),
        ("email.send", "clé", {}, {}, InvalidKey),
        ("", "k", {}, {}, InvalidArgument),
        ("email.send", "k", {}, {"max_attempts": 0}, InvalidArgument),
    ]
    with outbox.transaction(conn, schema=schema) as tx:
        for effect, key, payload, named, kind in cases:
            with pytest.raises(kind):
                tx.enqueue(effect, key=key, payload=payload, **named)


def test_an_effect_the_schema_does_not_know_is_refused(schema: str,
                                                       conn: psycopg.Connection[Any]) -> None:
    assert sql_enqueue(conn, schema, "anything.goes", "free", {}) is not None  # none listed
    conn.execute(sql.SQL("INSERT INTO {}.known_effects VALUES ('email.send'), ('sms.send')")
                 .format(sql.Identifier(schema)))
    assert sql_enqueue(conn, schema, "email.send", "known", {}) is not None
    error = _refusal(conn, schema, "email.sned", "typo", {})
    assert isinstance(error, UnknownEffect)
    assert str(error) == "effect 'email.sned' is not registered (registered: email.send, sms.send)"


def test_a_commit_wakes_listening_dispatchers(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(notify_channel(schema))))
        with psycopg.connect(dsn) as conn:
            sql_enqueue(conn, schema, "email.send", "wake", {})
            conn.commit()
        woken = next(listener.notifies(timeout=30, stop_after=1), None)
    assert woken is not None and woken.channel == notify_channel(schema)


@pytest.fixture
def enqueue_only_role(dsn: str, schema: str) -> Iterator[str]:
    """A login role granted exactly what the how-to grants: USAGE on the schema and
    EXECUTE on the function. Its connection string is yielded; the role is dropped after."""
    role = f"app_{uuid.uuid4().hex[:12]}"
    password = uuid.uuid4().hex
    grants = sql.SQL(
        "CREATE ROLE {role} LOGIN PASSWORD {password};"
        "GRANT USAGE ON SCHEMA {schema} TO {role};"
        "GRANT EXECUTE ON FUNCTION {schema}.enqueue(text, text, jsonb, timestamptz, text,"
        " integer, text, integer) TO {role};").format(
            role=sql.Identifier(role), password=sql.Literal(password),
            schema=sql.Identifier(schema))
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(grants)
    try:
        yield make_conninfo(dsn, user=role, password=password)
    finally:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP OWNED BY {role}; DROP ROLE {role}")
                          .format(role=sql.Identifier(role)))


def test_a_role_granted_the_function_may_enqueue_and_nothing_else(
        dsn: str, schema: str, enqueue_only_role: str) -> None:
    table = sql.SQL("{}.jobs").format(sql.Identifier(schema))
    with psycopg.connect(enqueue_only_role) as app:
        made = sql_enqueue(app, schema, "email.send", "by-app", {"to": "a"})
        assert sql_enqueue(app, schema, "email.send", "by-app", {"to": "a"}) == made
        app.commit()
        for statement in [
            sql.SQL("SELECT payload FROM {}").format(table),
            sql.SQL("UPDATE {} SET status = 'done'").format(table),
            sql.SQL("DELETE FROM {}").format(table),
            sql.SQL("INSERT INTO {} (effect, key, payload, fingerprint)"
                    " VALUES ('e', 'k', '{{}}', 'f')").format(table),
            sql.SQL("SELECT * FROM {}.effect_results").format(sql.Identifier(schema)),
            sql.SQL("INSERT INTO {}.known_effects VALUES ('x')").format(sql.Identifier(schema)),
        ]:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                app.execute(statement)
            app.rollback()
    with psycopg.connect(dsn) as conn:
        # PUBLIC may not execute it: a role given only USAGE on the schema cannot enqueue.
        assert conn.execute(
            "SELECT has_function_privilege('public', %s, 'EXECUTE')",
            (f"{sql.Identifier(schema).as_string(conn)}.enqueue(text, text, jsonb, timestamptz,"
             " text, integer, text, integer)",)).fetchone() == (False,)
    assert list(jobs(dsn, schema)) == ["by-app"]


def test_named_arguments_reach_the_job(schema: str, conn: psycopg.Connection[Any]) -> None:
    made = conn.execute(
        sql.SQL("SELECT {}.enqueue('email.send', 'named', '{{\"a\": 1}}',"
                " run_at => now() + interval '1 hour', group_key => 'tenant-1', priority => 5,"
                " ordering_key => 'order-1', max_attempts => 3)").format(sql.Identifier(schema))
    ).fetchone()
    job = jobs(conn, schema)["named"]
    assert made == (job["id"],)
    assert (job["group_key"], job["priority"], job["ordering_key"], job["max_attempts"]) == (
        "tenant-1", 5, "order-1", 3)
    assert job["payload"] == {"a": 1}
    assert conn.execute("SELECT %s > now() + interval '59 minutes'",
                        (job["available_at"],)).fetchone() == (True,)


def test_a_trigger_enqueues_for_a_role_granted_only_the_function(
        dsn: str, schema: str, enqueue_only_role: str) -> None:
    """The trigger's function runs as the writer: the role needs EXECUTE on enqueue and
    its own table, no right on the outbox's tables."""
    role = str(conninfo_to_dict(enqueue_only_role)["user"])
    names = {"s": sql.Identifier(schema), "role": sql.Identifier(role)}
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(sql.SQL(
            "CREATE TABLE {s}.orders (id int PRIMARY KEY);"
            "GRANT INSERT ON {s}.orders TO {role};"
            "CREATE FUNCTION {s}.orders_enqueue() RETURNS trigger LANGUAGE plpgsql AS $$"
            " BEGIN PERFORM {s}.enqueue('email.send', 'order-' || NEW.id,"
            " jsonb_build_object('order', NEW.id)); RETURN NULL; END $$;"
            "CREATE TRIGGER orders_enqueue AFTER INSERT ON {s}.orders"
            " FOR EACH ROW EXECUTE FUNCTION {s}.orders_enqueue()").format(**names))
    with psycopg.connect(enqueue_only_role) as app:
        app.execute(sql.SQL("INSERT INTO {s}.orders VALUES (5)").format(**names))
        app.commit()
    assert {key: job["payload"] for key, job in jobs(dsn, schema).items()} == {
        "order-5": {"order": 5}}
