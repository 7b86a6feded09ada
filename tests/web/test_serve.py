"""``outbox web``: loopback by default; refuses to expose itself unauthenticated."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from outbox.cli import main
from outbox.errors import ConfigurationError
from outbox.web import check_bind, is_loopback, password_from


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "[::1]", "localhost", "127.1.2.3"])
def test_loopback_addresses_are_recognised(host: str) -> None:
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.5", "example.com"])
def test_a_public_bind_without_authentication_is_refused(host: str) -> None:
    with pytest.raises(ConfigurationError, match="without authentication"):
        check_bind(host, authenticated=False)
    check_bind(host, authenticated=True)


def test_the_command_refuses_a_public_bind_without_a_password(
        dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OUTBOX_WEB_PASSWORD", raising=False)
    result = CliRunner().invoke(main, ["web", "--dsn", dsn, "--schema", schema,
                                       "--host", "0.0.0.0"])
    assert result.exit_code == 1
    assert "refusing to serve the dashboard on '0.0.0.0' without authentication" in result.output


def test_the_password_comes_from_a_file_or_the_environment(
        tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "pw"
    path.write_text("from-file\nignored\n")
    assert password_from(file=path) == "from-file"
    monkeypatch.setenv("OUTBOX_WEB_PASSWORD", "from-env")
    assert password_from() == "from-env"
    path.write_text("\n")
    with pytest.raises(ConfigurationError, match="is empty"):
        password_from(file=path)
