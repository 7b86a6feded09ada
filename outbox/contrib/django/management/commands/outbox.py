"""``manage.py outbox <command> ...``: the ``outbox`` command line on ``DATABASES``."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from outbox.contrib.django import conninfo, default_schema


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


class Command(BaseCommand):
    """Delegate to the ``outbox`` command with the database of ``--database``.

    Every sub-command (``migrate``, ``run``, ``status``, ``retry``, ``web`` and plug-ins)
    gets the connection string through ``OUTBOX_DATABASE_URL`` and the schema through
    ``OUTBOX_SCHEMA`` (``settings.OUTBOX_SCHEMA``), so an explicit ``--dsn`` or
    ``--schema`` still wins, and a dispatcher module can read them too.
    """

    help = "Run the outbox command line (migrate, run, status, retry, web) on DATABASES."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--database", default="default",
                            help="The DATABASES alias to use (default: 'default').")
        parser.add_argument("outbox_args", nargs=argparse.REMAINDER, metavar="COMMAND ...",
                            help="An outbox command and its options, e.g. 'status --json'.")

    def handle(self, *args: Any, **options: Any) -> None:
        from outbox.cli import main

        arguments = [*args, *options["outbox_args"]] or ["--help"]
        values = {"OUTBOX_DATABASE_URL": conninfo(options["database"]),
                  "OUTBOX_SCHEMA": default_schema()}
        with _environment(values):
            try:
                main.main(args=arguments, prog_name="manage.py outbox", standalone_mode=True)
            except SystemExit as exit_:
                if exit_.code not in (0, None):
                    code = exit_.code if isinstance(exit_.code, int) else 1
                    raise CommandError(f"outbox {arguments[0]} failed", returncode=code) from None
