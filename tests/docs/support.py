"""What the docs' tests share: a database of a page's own, as its reader would have, and
a command that hears Ctrl-C as in the reader's terminal."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo


@contextmanager
def own_database(dsn: str, prefix: str) -> Iterator[str]:
    """A new, empty database on ``dsn``'s server for the block (its connection string),
    dropped after it, whoever is still connected."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield make_conninfo(dsn, dbname=name)
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


# Resets SIGINT to its default, then becomes the command: a process started from a
# background job (a CI script's `... &`) inherits SIGINT ignored, and would never hear the
# Ctrl-C these tests send it, as a reader's terminal would deliver it.
_HEAR_CTRL_C = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                "os.execvp(sys.argv[1], sys.argv[1:])")


def hearing_ctrl_c(argv: list[str]) -> list[str]:
    """``argv`` run so that it hears SIGINT (Ctrl-C) whatever its parent ignores."""
    return [sys.executable, "-c", _HEAR_CTRL_C, *argv]
