"""The command line's errors: one line for what outbox raises on purpose, a traceback and
a request to report it for anything else (a bug of ours must not look like bad input)."""

from __future__ import annotations

import click
import psycopg
import pytest
from click.testing import CliRunner

from outbox import ConfigurationError
from outbox.cli import BUG_REPORT, _one_line_errors


def _command(error: BaseException) -> click.Command:
    @click.command()
    @_one_line_errors
    def failing() -> None:
        raise error

    return failing


@pytest.mark.parametrize("error", [
    ConfigurationError("schema 'x' has no outbox tables: run `outbox migrate`\nmore detail"),
    psycopg.OperationalError("connection refused"),
])
def test_an_error_raised_on_purpose_is_one_line(error: BaseException) -> None:
    result = CliRunner().invoke(_command(error))
    assert result.exit_code == 1
    assert result.output == f"Error: {str(error).splitlines()[0]}\n"
    assert "Traceback" not in result.output


@pytest.mark.parametrize("error", [
    AttributeError("'NoneType' object has no attribute 'id'"),
    ValueError("too many values to unpack"),
    KeyError("claim_version"),
])
def test_any_other_error_prints_its_traceback_and_says_it_is_a_bug(error: BaseException) -> None:
    result = CliRunner().invoke(_command(error))
    assert result.exit_code == 2
    assert "Traceback (most recent call last)" in result.output
    assert f"{type(error).__name__}: " in result.output
    assert result.output.rstrip().endswith(f"Error: {BUG_REPORT}")
