"""A Griffe extension: the dispatchers' parameter table from the declared options.

``outbox._dispatch.options.OPTIONS`` declares each option of ``Dispatcher`` and
``AsyncDispatcher`` with its text; ``outbox.dispatcher`` builds the constructors'
``__doc__`` (one ``:param`` line an option) from it at import. Griffe reads the source,
where that docstring has no parameter lines: this puts the built one in its place, so
the reference's table is the declaration's."""

from __future__ import annotations

import inspect
from typing import Any

import griffe

CONSTRUCTOR = "outbox.dispatcher._Options.__init__"


class OptionsDocstring(griffe.Extension):
    """Replace the dispatchers' constructor docstring with the one built at import."""

    def on_function_instance(self, *, func: griffe.Function, **kwargs: Any) -> None:
        if func.path != CONSTRUCTOR or func.docstring is None:
            return
        from outbox.dispatcher import _Options

        func.docstring.value = inspect.cleandoc(_Options.__init__.__doc__ or "")
