"""Who may look, who may act, and which requests are refused before any work.

- Access levels: ``"read"`` (pages, /metrics) and ``"operate"`` (actions too). An
  ``authorize(request)`` callable returns one of them, or None to refuse.
- Cross-site requests: a mutation carrying ``Sec-Fetch-Site: cross-site``/``same-site``,
  or an ``Origin`` naming another host, is refused with 403. A client sending neither
  header must echo the dashboard's CSRF cookie in the form (double submit).
- Every response carries a Content-Security-Policy that allows scripts and styles from
  the dashboard itself only, so text that slipped past escaping still could not run.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import inspect
import ipaddress
import os
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from starlette.requests import Request

from ..errors import ConfigurationError

Access = Literal["read", "operate"]
Authorizer = Callable[[Request], "Access | Awaitable[Access | None] | None"]

PASSWORD_ENV = "OUTBOX_WEB_PASSWORD"
CSRF_COOKIE = "outbox_csrf"
CSRF_FIELD = "csrf"

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
SECURITY_HEADERS = {
    "content-security-policy": CONTENT_SECURITY_POLICY,
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
    "x-frame-options": "DENY",
}


class BasicAuth:
    """HTTP Basic authentication against one shared password; grants ``operate``.

    Any user name is accepted with the right password and recorded as the actor of the
    actions taken (the name identifies, the password authenticates). The comparison
    takes the same time whatever the password tried.
    """

    challenge = 'Basic realm="outbox", charset="UTF-8"'

    def __init__(self, password: str, access: Access = "operate") -> None:
        if not password:
            raise ConfigurationError("the dashboard password must not be empty")
        self._password = password.encode()
        self.access: Access = access

    def user(self, request: Request) -> str | None:
        """The user name of a request carrying the right password, else None."""
        header = request.headers.get("authorization", "")
        scheme, _, encoded = header.partition(" ")
        if scheme.lower() != "basic" or not encoded:
            return None
        try:
            decoded = base64.b64decode(encoded.strip(), validate=True)
        except (binascii.Error, ValueError):
            return None
        name, sep, password = decoded.partition(b":")
        if not sep or not hmac.compare_digest(password, self._password):
            return None
        return name.decode("utf-8", "replace") or "anonymous"

    def __call__(self, request: Request) -> Access | None:
        return self.access if self.user(request) is not None else None


def password_from(env: str = PASSWORD_ENV, file: str | Path | None = None) -> str | None:
    """The dashboard password from a file (first line) or the environment, if set."""
    if file is not None:
        try:
            text = Path(file).read_text("utf-8")
        except OSError as exc:
            raise ConfigurationError(
                f"cannot read the password file {str(file)!r}: {exc.strerror}"
            ) from None
        password = text.splitlines()[0].strip() if text.strip() else ""
        if not password:
            raise ConfigurationError(f"the password file {str(file)!r} is empty")
        return password
    return os.environ.get(env) or None


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the dashboard on this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, *, authenticated: bool) -> None:
    """Refuse to serve a non-loopback address without authentication."""
    if not is_loopback(host) and not authenticated:
        raise ConfigurationError(
            f"refusing to serve the dashboard on {host!r} without authentication: set "
            f"{PASSWORD_ENV} or --password-file, or bind 127.0.0.1"
        )


async def access_of(authorize: Authorizer | None, request: Request) -> Access | None:
    """Apply the authorizer (sync or async); no authorizer means full access."""
    if authorize is None:
        return "operate"
    granted = authorize(request)
    if inspect.isawaitable(granted):
        granted = await granted
    if granted not in (None, "read", "operate"):
        raise ConfigurationError(
            f"authorize() must return None, 'read' or 'operate', got {granted!r}"
        )
    return granted


def actor_of(authorize: Authorizer | None, request: Request) -> str:
    """Who is acting, for the audit trail: the host app's user, the Basic user, or local."""
    user = request.scope.get("user")
    if user is not None and getattr(user, "is_authenticated", False):
        name = getattr(user, "display_name", "") or getattr(user, "identity", "")
        if name:
            return str(name)[:200]
    if isinstance(authorize, BasicAuth):
        basic = authorize.user(request)
        if basic:
            return basic[:200]
    client = request.client.host if request.client else "unknown"
    return f"anonymous@{client}"


def cross_site_reason(request: Request) -> str | None:
    """Why this mutation looks cross-site, or None when the headers say same-origin."""
    fetch_site = request.headers.get("sec-fetch-site")
    if fetch_site is not None:
        if fetch_site in ("same-origin", "none"):
            return None
        return f"Sec-Fetch-Site is {fetch_site}"
    origin = request.headers.get("origin")
    if origin is not None:
        host = request.headers.get("host", "")
        if origin == "null" or urlsplit(origin).netloc.lower() != host.lower():
            return "Origin names another site"
        return None
    return ""  # neither header: the caller must check the CSRF token


def token_matches(request: Request, submitted: object) -> bool:
    """The double-submit check: the form's token equals the dashboard's cookie."""
    cookie = request.cookies.get(CSRF_COOKIE, "")
    return (isinstance(submitted, str) and bool(cookie)
            and hmac.compare_digest(submitted.encode(), cookie.encode()))


def new_token() -> str:
    """A fresh CSRF token."""
    return secrets.token_urlsafe(32)
