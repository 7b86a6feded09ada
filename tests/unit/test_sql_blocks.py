"""Loading the named SQL blocks and binding a schema into them."""

from __future__ import annotations

from pathlib import Path

import pytest

from outbox import ConfigurationError
from outbox.sql import bind_blocks, bind_schema, core_fragments, parse_blocks, parse_sql, queries

REPO = Path(__file__).resolve().parents[2]


def test_blocks_are_split_by_name_and_comments_dropped() -> None:
    blocks = parse_blocks("-- name: a\n-- uses %(x)s\nSELECT 1;\n\n-- name: b\nSELECT 2;\n")
    assert blocks == {"a": "SELECT 1", "b": "SELECT 2"}


def test_duplicate_block_names_are_refused() -> None:
    with pytest.raises(ValueError, match="defined twice"):
        parse_blocks("-- name: a\nSELECT 1;\n-- name: a\nSELECT 2;\n")


def test_schema_is_quoted_as_an_identifier() -> None:
    bound = bind_schema("SELECT * FROM {schema}.jobs", 'we"ird; DROP TABLE x')
    assert bound == 'SELECT * FROM "we""ird; DROP TABLE x".jobs'


@pytest.mark.parametrize("schema", ["", "x" * 64, "a\x00b"])
def test_impossible_schema_names_are_refused(schema: str) -> None:
    with pytest.raises(ConfigurationError, match="schema name"):
        queries(schema)


def test_unknown_query_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no query named 'nope'"):
        _ = queries("outbox").nope


def test_fragments_are_bound_into_the_blocks_that_name_them_and_are_no_query() -> None:
    found = parse_sql("-- fragment: due\n-- a rule\nj.at <= now() AND j.s = {schema}.x\n"
                      "-- name: a\nSELECT 1 FROM {schema}.t j WHERE {due};\n")
    assert found.fragments == {"due": "j.at <= now() AND j.s = {schema}.x"}
    assert parse_blocks("-- fragment: due\nTRUE\n-- name: a\nSELECT 1;\n") == {"a": "SELECT 1"}
    assert bind_blocks(found.blocks, "s", found.fragments) == {
        "a": 'SELECT 1 FROM "s".t j WHERE j.at <= now() AND j.s = "s".x'}
    with pytest.raises(ValueError, match="no fragment named 'due'"):
        bind_blocks(found.blocks, "s")


def test_the_claimable_rule_is_written_once_in_the_products_sql() -> None:
    rule = "WHERE o.ordering_key = j.ordering_key AND o.status IN ('pending', 'running')"
    sql_files = [p for p in (REPO / "outbox").rglob("*.sql")]
    assert sum(p.read_text().count(rule) for p in sql_files) == 1
    claim_users = ("claim", "has_due_work", "limit_claim")
    assert all(rule in getattr(queries("outbox"), name) for name in claim_users)
    fragments = core_fragments()
    queue_file = parse_sql((REPO / "outbox" / "sql" / "queue.sql").read_text())
    queue = bind_blocks(queue_file.blocks, "outbox", fragments)
    assert rule in queue["effect_health"] and rule in queue["due_by_effect"]
