"""``manage.py outbox <command> ...``: the ``outbox`` command line on ``DATABASES``."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import click
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from outbox.contrib.django import conninfo, default_schema

# Django's own options, which manage.py has already read wherever they stand: dropped
# from what goes to the outbox command ("takes a value" or not).
_DJANGO_OPTIONS = {"--database": True, "--settings": True, "--pythonpath": True,
                   "--verbosity": True, "-v": True, "--traceback": False,
                   "--no-color": False, "--force-color": False, "--skip-checks": False}


@contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def split_arguments(arguments: Sequence[str]) -> tuple[list[str], str | None]:
    """The outbox command's arguments without Django's options, and ``--database``'s
    value if given (before or after the sub-command: both mean the same)."""
    kept: list[str] = []
    database: str | None = None
    items = iter(arguments)
    for item in items:
        name, equals, value = item.partition("=")
        if item == "--":
            kept.append(item)
            kept.extend(items)
            break
        if name not in _DJANGO_OPTIONS:
            kept.append(item)
            continue
        if _DJANGO_OPTIONS[name] and not equals:
            value = next(items, "")
            if not value:
                raise CommandError(f"{name} needs a value")
        if name == "--database":
            database = value
    return kept, database


# Built-in commands that have nothing to do with DATABASES.
_NOT_UNDER_DJANGO = {"dev-server"}


def django_group() -> click.Group:
    """The outbox command line as ``manage.py outbox`` offers it: the built-in commands
    that work on ``DATABASES``. Plug-ins (``demo``, ``chaos``) and ``dev-server`` start
    servers and processes of their own and ignore it; they stay on ``outbox``."""
    from outbox.cli import main

    commands = {name: c for name, c in main.commands.items() if name not in _NOT_UNDER_DJANGO}
    return click.Group(
        name="manage.py outbox", commands=commands, params=list(main.params),
        callback=main.callback, help=main.help,
        epilog="Django's options go before or after the command: --database ALIAS "
               "(default 'default'), --settings, --pythonpath. The schema is "
               "settings.OUTBOX_SCHEMA (default 'outbox'); with OUTBOX_SCHEMA_PER_TENANT "
               "(django-tenants), the public schema: --schema NAME for a tenant's, "
               "--targets outbox.contrib.django:tenant_targets for all of them.",
    )


def _run(group: click.Group, arguments: list[str]) -> None:
    try:
        code = group.main(args=arguments, prog_name="manage.py outbox", standalone_mode=False)
    except click.UsageError as exc:
        path = exc.ctx.command_path if exc.ctx else "manage.py outbox"
        raise CommandError(f"{exc.format_message()} (see: {path} --help)") from None
    except click.ClickException as exc:
        raise CommandError(exc.format_message(), returncode=exc.exit_code) from None
    except click.Abort:
        raise CommandError("aborted") from None
    if isinstance(code, int) and code != 0:
        raise CommandError(f"exited with status {code}", returncode=code)


class Command(BaseCommand):
    """Delegate to the ``outbox`` command with the database of ``--database``.

    Every sub-command (``migrate``, ``run``, ``status``, ``retry``, ``web``) gets the
    connection string through ``OUTBOX_DATABASE_URL`` and the schema through
    ``OUTBOX_SCHEMA`` (``default_schema()``), so an explicit ``--dsn`` or
    ``--schema`` still wins, and a dispatcher module can read them too. ``--database``
    goes before or after the sub-command; every error is one line.
    """

    help = "Run the outbox command line (migrate, run, status, retry, web) on DATABASES."

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        # `manage.py outbox --help` and `manage.py help outbox` list the outbox commands.
        setattr(parser, "print_help", lambda file=None: _run(django_group(), ["--help"]))  # noqa: B010
        return parser

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--database", default=None,
                            help="The DATABASES alias to use (default: 'default').")
        parser.add_argument("outbox_args", nargs=argparse.REMAINDER, metavar="COMMAND ...",
                            help="An outbox command and its options, e.g. 'status --json'.")

    def handle(self, *args: Any, **options: Any) -> None:
        arguments, database = split_arguments([*args, *options["outbox_args"]])
        alias = database or options["database"] or "default"
        if alias not in settings.DATABASES:
            known = ", ".join(sorted(settings.DATABASES)) or "none"
            raise CommandError(f"no database {alias!r} in DATABASES (known: {known})")
        values = {"OUTBOX_DATABASE_URL": conninfo(alias),
                  "OUTBOX_SCHEMA": default_schema(alias)}
        with _environment(values):
            _run(django_group(), arguments or ["--help"])
