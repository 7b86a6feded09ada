"""An operator pauses one group (tenant) of an effect: its jobs wait, no attempt counted,
while the effect's other groups are performed; audited, shown by `outbox status`, ended
by `outbox resume --group`."""

from __future__ import annotations

import json
from typing import Any

import psycopg
from click.testing import CliRunner, Result

import outbox
from outbox import Dispatcher, NewJob
from outbox.cli import main
from outbox.testing import jobs

from .test_fair_claim import Ordered


def cli(dsn: str, schema: str, *args: str) -> Result:
    return CliRunner().invoke(main, [args[0], "--dsn", dsn, "--schema", schema, *args[1:]])


def ok(result: Result) -> str:
    assert result.exit_code == 0, result.output
    return result.output


def enqueue(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn) as conn, outbox.transaction(conn, schema=schema) as tx:
        tx.enqueue_many([NewJob("test.ordered", key=f"acme-{n}", payload={}, group="acme")
                         for n in range(3)]
                        + [NewJob("test.ordered", key=f"beta-{n}", payload={}, group="beta")
                           for n in range(2)]
                        + [NewJob("test.ordered", key="plain", payload={})])


def audit(dsn: str, schema: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(f'SELECT actor, action, detail, affected FROM "{schema}".'
                            "dashboard_audit ORDER BY id").fetchall()


def test_a_paused_group_waits_while_the_others_are_performed_until_resumed(
        dsn: str, schema: str) -> None:
    enqueue(dsn, schema)
    out = ok(cli(dsn, schema, "pause", "test.ordered", "--group", "acme", "--actor", "ada"))
    assert "group acme of effect test.ordered paused until resumed" in out
    effect = Ordered()
    # run_until_idle does not wait for the paused group: it returns once the rest is done.
    Dispatcher(dsn, [effect], schema=schema).run_until_idle(timeout=30)
    assert sorted(effect.order) == ["beta-0", "beta-1", "plain"]
    with psycopg.connect(dsn) as conn:
        waiting = {k: (j["status"], j["attempts"]) for k, j in jobs(conn, schema).items()
                   if k.startswith("acme")}
    assert waiting == {f"acme-{n}": ("pending", 0) for n in range(3)}, "no attempt counted"
    report = json.loads(ok(cli(dsn, schema, "status", "--json")))
    assert report["paused_groups"] == [
        {"effect": "test.ordered", "group": "acme", "by": "ada", "until": None}]
    assert report["paused_effects"] == []
    assert "test.ordered group acme by ada, until resumed" in ok(cli(dsn, schema, "status"))

    assert "group acme of effect test.ordered resumed" in ok(
        cli(dsn, schema, "resume", "test.ordered", "--group", "acme", "--actor", "ada"))
    Dispatcher(dsn, [effect], schema=schema).run_until_idle(timeout=30)
    assert sorted(effect.order) == ["acme-0", "acme-1", "acme-2", "beta-0", "beta-1", "plain"]
    assert "was not paused" in ok(
        cli(dsn, schema, "resume", "test.ordered", "--group", "acme", "--actor", "ada"))
    assert [(a[0], a[1], a[2].get("group"), a[3]) for a in audit(dsn, schema)] == [
        ("ada", "pause", "acme", 1), ("ada", "resume", "acme", 1), ("ada", "resume", "acme", 0)]


def test_a_group_with_no_unfinished_job_is_refused_unless_forced(dsn: str, schema: str) -> None:
    enqueue(dsn, schema)
    typo = cli(dsn, schema, "pause", "test.ordered", "--group", "acem")
    assert typo.exit_code == 2, typo.output
    assert "effect 'test.ordered' has no unfinished job in group 'acem'" in typo.output
    assert audit(dsn, schema) == []
    assert "paused for 10m" in ok(cli(dsn, schema, "pause", "test.ordered", "--group", "acem",
                                      "--for", "10m", "--force"))
    [paused] = json.loads(ok(cli(dsn, schema, "status", "--json")))["paused_groups"]
    assert paused["group"] == "acem" and paused["until"] is not None
    empty = cli(dsn, schema, "pause", "test.ordered", "--group", "")
    assert empty.exit_code == 2 and "a group is 1 to 255 characters" in empty.output
