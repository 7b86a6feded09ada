"""The outbox dashboard (``outbox-pg[web]``): an ASGI app to watch and operate the queue.

``create_app(conninfo, schema=..., read_only=..., authorize=..., redact=...)`` returns a
Starlette application: run it with ``outbox web`` (uvicorn, loopback by default) or
mount it in your own application. ``create_app(targets=[outbox.Target(dsn, schema),
...])`` (or a function returning them) shows several outboxes, a picker switching
between them. See ``create_app`` for its guarantees.
"""

try:  # outbox-pg[web]
    import jinja2  # noqa: F401
    import starlette  # noqa: F401
except ModuleNotFoundError as exc:
    from .._extras import missing_extra

    raise missing_extra(exc, "outbox.web", "web") from exc

from ._security import Access, Authorizer, BasicAuth, check_bind, is_loopback, password_from
from ._targets import slug_of as target_slug
from ._targets import slugs as target_slugs
from ._views import Redactor, truncate_payload
from .app import create_app

__all__ = [
    "Access",
    "Authorizer",
    "BasicAuth",
    "Redactor",
    "check_bind",
    "create_app",
    "is_loopback",
    "password_from",
    "target_slug",
    "target_slugs",
    "truncate_payload",
]
