"""``outbox web``: the dashboard under uvicorn, loopback unless a password is set."""

from __future__ import annotations

import psycopg
import uvicorn

from ..migrate import require_current
from ._security import BasicAuth, check_bind, password_from
from ._targets import TargetsSource, checked_targets
from .app import create_app


def serve(dsn: str | None, *, schema: str, host: str, port: int, read_only: bool,
          password_file: str | None, targets: TargetsSource | None = None) -> None:
    """Check the bind and the schema (with targets: that their list reads), then serve
    until interrupted."""
    password = password_from(file=password_file)
    check_bind(host, authenticated=password is not None)
    authorize = BasicAuth(password) if password else None
    if targets is not None:
        # A target out of reach is shown as such; a list that cannot be had stops here.
        checked_targets(targets() if callable(targets) else targets)
        app = create_app(targets=targets, read_only=read_only, authorize=authorize)
    else:
        assert dsn is not None
        with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
            require_current(conn, schema)
        app = create_app(dsn, schema=schema, read_only=read_only, authorize=authorize)
    uvicorn.run(app, host=host, port=port, log_level="info", proxy_headers=False)
