"""The dispatchers' options, declared once: each keyword argument of ``Dispatcher`` and
``AsyncDispatcher`` with its default, its unit, its reference text and who reads it.

Every reader takes its list from ``OPTIONS``:

    constructors  ``_Options.__init__`` keeps explicit keyword parameters (so mypy and an
                  IDE see them) and hands what it was given, by these names, on
    settings      the options ``Settings.build`` checks (``settings=True``), the one
                  validation, whose defaults are these
    attributes    the checked values readable as ``d.lease`` ... (``public=True``)
    engines       what each engine of a fleet is given, as the constructor was
                  (``engine=True``); the rest reach it through the checked settings
    reference     the constructors' ``:param`` lines (their ``__doc__``, and the docs'
                  parameter table through ``docs/griffe_options.py``) are built from
                  ``doc`` and ``unit``
    CLI           ``outbox run``'s flags that set the option (``cli``); a flag changing
                  an option of a loaded dispatcher goes through ``_Options._set_options``,
                  checked as the constructor checks it

``tests/unit/test_options.py`` fails when the constructors, ``Settings.build``, the
attributes, the engines, the reference or the CLI leave out an option or disagree on a
default. Adding an option: a row here, a keyword in the constructor's signature, and
where ``Settings.build`` checks it.
"""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

__all__ = [
    "CLI_FLAGS",
    "ENGINE_OPTIONS",
    "OPTIONS",
    "PUBLIC_OPTIONS",
    "SETTINGS_OPTIONS",
    "Option",
    "docstring",
    "option",
    "settings_options",
]


@dataclass(frozen=True)
class Option:
    """One keyword argument of the dispatchers' constructors."""

    name: str
    default: Any
    doc: str  # the reference's text, one sentence or a few; the unit is added
    unit: str = ""  # "seconds", "jobs", ...: said in the reference after the text
    settings: bool = True  # checked by Settings.build into a field of that name
    public: bool = False  # readable as an attribute of the dispatcher (checked value)
    engine: bool = False  # given to each engine of a fleet as given to the constructor
    cli: tuple[str, ...] = ()  # the ``outbox run`` flags that set it

    def reference(self) -> str:
        """The text of its ``:param`` line: ``doc``, with the unit when there is one."""
        if not self.unit:
            return self.doc
        text = self.doc.removesuffix(".")
        return f"{text} ({self.unit}){self.doc[len(text):]}"


_SECONDS = "seconds, or a timedelta"

OPTIONS: tuple[Option, ...] = (
    Option("conninfo", None, "The database's connection string (libpq key=value or a "
           "``postgresql://`` URL); or None with ``targets``."),
    Option("effects", None, "The effects this dispatcher performs; only their jobs are "
           "claimed."),
    Option("schema", "outbox", "The schema holding the outbox tables.", public=True),
    Option("concurrency", 16, "Performs in flight at once, sync and async effects "
           "together.", unit="performs", public=True, engine=True),
    Option("lease", 30.0, "A claim's lifetime (at least 1 second); heartbeats extend it "
           "while an effect runs, and a job whose lease expires is performed again, same "
           "key.", unit=_SECONDS, public=True, engine=True),
    Option("batch_size", None, "The most jobs one claim takes; None: the larger of "
           "``concurrency`` and 500.", unit="jobs", public=True, engine=True),
    Option("prefetch", None, "Claimed jobs that may wait for a free worker; None adapts "
           "it to about one second of work, 0 claims only what can start at once.",
           unit="jobs", public=True, engine=True),
    Option("max_prefetch", 4000, "The cap of the adaptive ``prefetch``.", unit="jobs",
           public=True, engine=True),
    Option("poll_interval", 1.0, "How long to wait for work between claims when no "
           "notification arrives (LISTEN wakes it sooner).", unit=_SECONDS, public=True,
           engine=True),
    Option("rescue_interval", None, "How often expired leases are taken back; None: the "
           "smaller of ``lease`` and 5 seconds.", unit=_SECONDS, public=True, engine=True),
    Option("backoff", None, "The delay before a retry (``outbox.Backoff``, capped "
           "exponential with full jitter); None: the default one.", public=True,
           engine=True),
    Option("unknown_outcome_window", timedelta(hours=24), "How long after a job's first "
           "attempt an ``UnknownOutcome`` is retried with the same key before the job goes "
           "to ``reconcile`` (an effect's own window wins).", unit=_SECONDS, public=True,
           engine=True),
    Option("retention", timedelta(days=7), "How long done jobs are kept; None keeps them, "
           "0 deletes a job as it completes.", unit=_SECONDS, public=True, engine=True),
    Option("ledger_retention", timedelta(days=90), "How long ledger rows (the keys already "
           "performed) are kept, never shorter than ``retention``; None keeps them.",
           unit=_SECONDS, public=True, engine=True),
    Option("inbox_retention", timedelta(days=7), "How long inbox rows (``tx.receive``) are "
           "kept; None keeps them.", unit=_SECONDS, public=True, engine=True),
    Option("worker_id", None, "This process's name in leases, logs and ``outbox status``; "
           "None: ``host:pid:random``.", public=True),
    Option("listen_conninfo", None, "A direct connection string for LISTEN when "
           "``conninfo`` goes through a transaction-pooling PgBouncer."),
    Option("observer", None, "An ``outbox.observe.DispatchObserver`` told of every claim, "
           "attempt, fence rejection and rescue."),
    Option("metrics", False, "Add the Prometheus metrics (needs "
           "``outbox-pg[prometheus]``).", settings=False),
    Option("on_done", None, "Effect name to a hook run in the transaction that records the "
           "job done (in place of the effect's own ``on_done``).", engine=True),
    Option("on_failed", None, "Effect name to a hook run in the transaction that records "
           "the job failed.", engine=True),
    Option("reconcile_interval", 60.0, "How often jobs in ``reconcile`` are asked about, "
           "for effects that define ``reconcile``.", unit=_SECONDS, public=True,
           engine=True),
    Option("limits", None, "Effect name to ``outbox.Limit`` (rate per second, "
           "concurrency), counted in the database across every dispatcher.",
           cli=("--limit",)),
    Option("breaker_threshold", 5, "Transient failures of an effect in a row that pause it "
           "for every dispatcher; None turns the breaker off.", unit="failures",
           engine=True),
    Option("stop_timeout", 30.0, "How long, after a stop, performs in flight get to finish "
           "and be recorded before ``run`` returns anyway.", unit=_SECONDS, public=True,
           engine=True, cli=("--stop-timeout",)),
    Option("targets", None, "Several outboxes (``outbox.Target``s, or a callable returning "
           "them) served by this one process, instead of ``conninfo``.", settings=False,
           cli=("--target", "--targets")),
    Option("targets_interval", 30.0, "How often a callable ``targets`` is read again.",
           unit=_SECONDS, settings=False),
    Option("max_connections", 16, "The most connections this process holds across all its "
           "targets.", unit="connections", settings=False, cli=("--max-connections",)),
    Option("quiet_look_interval", 30.0, "With ``targets``: how often a polled database "
           "(past the budget's listeners) is still looked at while its server's statistics "
           "show no write in it since its last look and no job of it falls due; otherwise "
           "every ``poll_interval``. A listened schema is likewise still asked while no "
           "notification, turn, due job or awake mark's end came since its last look.",
           unit=_SECONDS, settings=False),
    Option("limits_home", None, "Where ``Limit(shared=True)`` limits are counted: an "
           "``outbox.Target``, or a connection string for schema ``outbox``.",
           cli=("--limits-home",)),
    Option("schedules", None, "Recurring effects (``outbox.Schedule``s) this dispatcher "
           "fires, each slot enqueued once across every dispatcher of the schema.",
           settings=False, engine=True),
    Option("wait_for_replicas", False, "Perform a claimed job only once every streaming "
           "standby holds its commit, or those named (``[\"standby1\"]``: their "
           "``application_name``); the role needs ``pg_monitor``.", public=True,
           engine=True, cli=("--wait-for-replicas", "--wait-for-standby")),
)

_BY_NAME = {option.name: option for option in OPTIONS}
# conninfo and effects are Settings.build's positional arguments.
SETTINGS_OPTIONS = tuple(o.name for o in OPTIONS
                         if o.settings and o.name not in ("conninfo", "effects"))
PUBLIC_OPTIONS = tuple(o.name for o in OPTIONS if o.public)
ENGINE_OPTIONS = tuple(o.name for o in OPTIONS if o.engine)
CLI_FLAGS = {flag: o.name for o in OPTIONS for flag in o.cli}


def settings_options(given: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of ``Settings.build`` among ``given`` (the constructor's)."""
    return {name: given[name] for name in SETTINGS_OPTIONS}


def option(name: str) -> Option:
    """The option ``name`` (``KeyError`` for another name)."""
    return _BY_NAME[name]


def docstring(head: str, tail: str, indent: str = "        ") -> str:
    """A constructor's docstring: ``head``, a ``:param`` line for every option in the
    signature's order (the reference's parameter table), then ``tail``."""
    lines = [inspect.cleandoc(head), ""]
    for spec in OPTIONS:
        lines.extend(textwrap.wrap(f":param {spec.name}: {spec.reference()}", width=84,
                                   subsequent_indent="    "))
    lines.append(inspect.cleandoc(tail))
    text = "\n".join(lines).splitlines()
    return "\n".join([text[0], *(indent + line if line else "" for line in text[1:])])
