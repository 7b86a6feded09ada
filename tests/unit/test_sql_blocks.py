"""Loading the named SQL blocks and binding a schema into them."""

from __future__ import annotations

import pytest

from outbox import ConfigurationError
from outbox.sql import bind_schema, parse_blocks, queries


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
