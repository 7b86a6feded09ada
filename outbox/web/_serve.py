"""``outbox web``: the dashboard under uvicorn, loopback unless a password is set."""

from __future__ import annotations

import psycopg
import uvicorn

from ..migrate import require_current
from ._security import BasicAuth, check_bind, password_from
from .app import create_app


def serve(dsn: str, *, schema: str, host: str, port: int, read_only: bool,
          password_file: str | None) -> None:
    """Check the bind and the schema, then serve until interrupted."""
    password = password_from(file=password_file)
    check_bind(host, authenticated=password is not None)
    with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
        require_current(conn, schema)
    authorize = BasicAuth(password) if password else None
    app = create_app(dsn, schema=schema, read_only=read_only, authorize=authorize)
    uvicorn.run(app, host=host, port=port, log_level="info", proxy_headers=False)
