"""Code outside the ``outbox`` package reaches it only through public modules.

Shipped code (``effects``, ``examples``, ``benchmarks``) and the tests use ``outbox``,
``outbox.testing``, ``outbox.sql`` and the other public modules, never a private
``outbox._x``: what they need is a seam users may need too. The one exception is a
unit test of a pure private module, which tests that module itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("effects", "examples", "benchmarks", "tests")

# Unit and property tests of private modules themselves: the pure decisions, and the
# dispatcher's parts driven one at a time.
UNIT_TESTS_OF_PRIVATE_MODULES = {
    "tests/integration/test_dispatcher_parts.py": {"outbox._dispatch", "outbox._steps"},
    "tests/unit/test_lifecycle_rules.py": {"outbox._lifecycle"},
    "tests/unit/test_settlement.py": {"outbox._lifecycle"},
    "tests/unit/test_told_settlement.py": {"outbox._lifecycle"},
    "tests/unit/test_reconciler.py": {"outbox._dispatch", "outbox._lifecycle"},
    "tests/unit/test_presence.py": {"outbox._dispatch"},
    "tests/unit/test_enqueue_prepare.py": {"outbox._enqueue"},
    "tests/unit/test_steps.py": {"outbox._enqueue", "outbox._steps"},
    "tests/unit/test_step_drivers.py": {"outbox._dispatch", "outbox._enqueue", "outbox._steps"},
    "tests/property/test_decisions.py": {"outbox._lifecycle"},
    "tests/property/test_lifecycle.py": {"outbox._lifecycle", "outbox._queue"},
    "tests/web/test_counts.py": {"outbox._queue"},
    "tests/web/test_queue_reporting.py": {"outbox._queue"},
    "tests/integration/test_recorder_failures.py": {"outbox._dispatch", "outbox._steps"},
    "tests/flows/test_hook_chunks.py": {"outbox._dispatch"},
    "tests/integration/test_step_rows.py": {"outbox._steps"},
    "tests/unit/test_dispatch_rounds.py": {"outbox._after", "outbox._dispatch", "outbox._steps"},
    "tests/unit/test_task_workers.py": {"outbox._dispatch"},
    "tests/unit/test_daemon_pool.py": {"outbox._dispatch"},
    "tests/unit/test_claimed_jobs.py": {"outbox._cancelling", "outbox._dispatch", "outbox._steps"},
    "tests/integration/test_claimed_columns.py": {"outbox._dispatch", "outbox._steps"},
    "tests/integration/test_serving.py": {"outbox._dispatch"},
    "tests/unit/test_stop_watch.py": {"outbox._dispatch"},
    "tests/targets/test_fleet_quiet.py": {"outbox._dispatch", "outbox._steps"},
    "tests/targets/test_fleet_listened.py": {"outbox._dispatch", "outbox._enqueue",
                                             "outbox._steps"},
    "tests/unit/test_looks.py": {"outbox._dispatch"},
    "tests/plans/test_fenced_writes.py": {"outbox._dispatch"},
    "tests/integration/test_ledger_indexes.py": {"outbox._dispatch"},
    "tests/unit/test_hook_sending.py": {"outbox._dispatch"},
    "tests/unit/test_embedded_bounds.py": {"outbox._embedded"},
    "tests/crash/test_claim_round_connection_loss.py": {"outbox._dispatch", "outbox._steps"},
    "tests/failover/test_network_options.py": {"outbox._dispatch"},
    "tests/unit/test_options.py": {"outbox._dispatch"},
    "tests/targets/test_crew.py": {"outbox._dispatch"},
    "tests/crash/test_claim_races.py": {"outbox._lifecycle"},
    "tests/integration/test_lifecycle_sources.py": {"outbox._lifecycle", "outbox._queue"},
    "tests/integration/test_rescue_lifecycle.py": {"outbox._queue", "outbox._lifecycle"},
    "tests/property/test_rescue_decision.py": {"outbox._lifecycle"},
    "tests/unit/test_transitions.py": {"outbox._lifecycle", "outbox._sql"},
    "tests/integration/test_decided_sources.py": {"outbox._after", "outbox._dispatch",
                                                  "outbox._lifecycle", "outbox._queue",
                                                  "outbox._steps"},
    "tests/property/test_operator_decisions.py": {"outbox._lifecycle"},
    "tests/unit/test_cancelled_meanwhile.py": {"outbox._lifecycle"},
    "tests/cancel/test_cancelled_meanwhile.py": {"outbox._dispatch", "outbox._lifecycle",
                                                 "outbox._queue"},
    "tests/cancel/test_cancelled_meanwhile_reported.py": {"outbox._dispatch",
                                                          "outbox._lifecycle"},
    # The loops' two drivers, and their instructions on a real database.
    "tests/unit/test_runtime.py": {"outbox._dispatch"},
    "tests/integration/test_runtime_loops.py": {"outbox._dispatch", "outbox._steps"},
    # The rescue's batch timed beside the statement it replaced: the rescuer itself.
    "benchmarks/rescue.py": {"outbox._dispatch", "outbox._steps"},
    # The steps' drivers timed beside the one driver that would replace both.
    "benchmarks/step_drivers.py": {"outbox._steps"},
    # The recorder's settle, its claims built as the recorder builds them.
    "benchmarks/statement_cpu.py": {"outbox._dispatch", "outbox._lifecycle"},
    # The rule of a parent's settlement as data, and the SQL rendered from it.
    "tests/unit/test_parent_rule.py": {"outbox._lifecycle", "outbox._rule_sql"},
    "tests/after/test_parent_rule_sql.py": {"outbox._dispatch", "outbox._lifecycle",
                                            "outbox._rule_sql", "outbox._sql"},
}


def private_uses(source: str) -> set[str]:
    """Every private ``outbox._x`` module that ``source`` imports or reaches by attribute."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if _private(a.name)}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if _private(node.module):
                found.add(node.module)
            elif node.module == "outbox":
                found |= {f"outbox.{a.name}" for a in node.names if _underscored(a.name)}
        elif isinstance(node, ast.Attribute) and _private(_dotted(node)):
            found.add(_dotted(node))
    return {".".join(name.split(".")[:2]) for name in found}


def _private(module: str) -> bool:
    parts = module.split(".")
    return parts[0] == "outbox" and any(_underscored(p) for p in parts[1:])


def _underscored(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")  # __all__, __version__


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def _sources() -> list[Path]:
    return sorted(p for top in SCANNED for p in (ROOT / top).rglob("*.py")
                  if "peers" not in p.parts)


@pytest.mark.parametrize(
    "source", ["import outbox._sql", "from outbox._embedded import start_server",
               "from outbox import _enqueue", "import outbox\noutbox._sql.queries('x')",
               "from outbox.testing._x import y"])
def test_the_scan_finds_every_form_of_private_import(source: str) -> None:
    assert private_uses(source)


def test_the_scan_lets_public_modules_through() -> None:
    assert not private_uses("import outbox\nfrom outbox.testing import jobs\n"
                            "from outbox.sql import queries\nfrom . import _support\n"
                            "outbox.transaction\n")


def test_nothing_outside_the_package_imports_a_private_outbox_module() -> None:
    offenders = {}
    for path in _sources():
        name = path.relative_to(ROOT).as_posix()
        uses = private_uses(path.read_text("utf-8"))
        uses -= UNIT_TESTS_OF_PRIVATE_MODULES.get(name, set())
        if uses:
            offenders[name] = sorted(uses)
    assert offenders == {}, "use a public module (outbox.testing, outbox.sql, ...) instead"
