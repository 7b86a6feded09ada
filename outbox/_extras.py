"""The optional extras, named at import: a module that needs one says which to install.

``import outbox.metrics`` without prometheus-client raises ``ModuleNotFoundError`` saying
``pip install 'outbox-pg[prometheus]'`` rather than a bare ``No module named ...``; the
error keeps the missing module's ``name``, so callers that look at it still can.
"""

from __future__ import annotations

__all__ = ["missing_extra"]


def missing_extra(exc: ModuleNotFoundError, module: str, extra: str) -> ModuleNotFoundError:
    """The error to raise when ``module`` cannot import ``exc.name`` of ``extra``."""
    top = (exc.name or extra).partition(".")[0]
    return ModuleNotFoundError(
        f"{module} needs {top}, which is not installed: pip install 'outbox-pg[{extra}]'",
        name=exc.name)
