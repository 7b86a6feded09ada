"""``outbox chaos`` (and ``python -m effects.chaos``): the chaos runner's command line."""

from __future__ import annotations

import random
import signal
import sys

import click
from rich.console import Console

from outbox import Limit

from .config import (
    FAULT_KINDS,
    GROUP_LIMITS,
    MAX_TARGETS,
    OPT_IN_FAULTS,
    ChaosConfig,
    parse_faults,
    parse_limits,
)

__all__ = ["command"]


def _limits(ctx: click.Context, param: click.Parameter,
            value: tuple[str, ...]) -> dict[str, Limit] | None:
    try:
        return parse_limits(value) if value else None
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _faults(ctx: click.Context, param: click.Parameter, value: str) -> frozenset[str]:
    try:
        return parse_faults(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@click.command("chaos")
@click.option("--workers", default=3, show_default=True, help="Dispatcher processes.")
@click.option("--jobs", default=3000, show_default=True, help="Committed jobs to drain.")
@click.option("--duration", default=40.0, show_default=True,
              help="Seconds of chaos: faults injected and jobs enqueued meanwhile.")
@click.option("--deadline", default=None, type=float,
              help="Seconds for the whole run; unfinished jobs then count as lost "
                   "[default: duration + 200].")
@click.option("--seed", default=None, type=int, help="Replay a run's jobs and faults.")
@click.option("--dsn", default=None, metavar="DSN",
              help="Use this server (a database of the run's own, dropped afterwards; "
                   "no restart fault) instead of an embedded PostgreSQL.")
@click.option("--json", "json_path", default=None, metavar="PATH",
              help="Also write the report as JSON to PATH.")
@click.option("--faults", "faults", default="all", show_default=True, callback=_faults,
              help=f"Comma-separated fault kinds: {','.join(FAULT_KINDS)}; all or none; "
                   f"only when named: {','.join(OPT_IN_FAULTS)} (the database fails over to "
                   "a streaming standby; not with --dsn).")
@click.option("--lease", default=2.0, show_default=True, help="Dispatcher lease, seconds.")
@click.option("--slack", default=8.0, show_default=True,
              help="Allowed seconds past lease + rescue interval for a job to stay running.")
@click.option("--fault-spacing", default=1.0, show_default=True,
              help="Seconds between faults of each kind, as a multiple of CI intensity (a "
              "kill every 4 s): 10 for a soak of an hour or a million jobs.")
@click.option("--keep-logs", is_flag=True, help="Keep worker logs even when all is well.")
@click.option("--groups", default=0, show_default=True,
              help="Spread the jobs over N groups (tenants): one takes half of them, a few "
                   "have none; some get a priority (10 or -5). 0: no groups.")
@click.option("--targets", default=1, show_default=True,
              type=click.IntRange(1, MAX_TARGETS),
              help="Outbox schemas in the run's database: above 1, each worker runs one "
                   "fleet dispatcher (Dispatcher(targets=[...])) over them all, the jobs' "
                   "batches spread over them, and every check holds in each.")
@click.option("--limit", "limits", multiple=True, callback=_limits, metavar="EFFECT=LIMIT",
              help="A limit every worker declares, as outbox run --limit reads it "
                   "(email.send=25/s,per_group); repeat for several effects, none for no "
                   "limit. With --groups the default is "
                   + "; ".join(f"{e}={limit}" for e, limit in GROUP_LIMITS.items()) + ".")
@click.option("--failover-lag", default=2.0, show_default=True,
              help="With the failover fault: seconds the standby's WAL receipt is stalled "
                   "before the primary is killed (the commits of those seconds are lost).")
@click.option("--wait-for-replicas/--no-wait-for-replicas", default=True, show_default=True,
              help="With the failover fault: the workers perform a job only once the "
                   "standby has its commit; without, effects for lost orders are performed "
                   "(phantoms: the run fails).")
def command(workers: int, jobs: int, duration: float, deadline: float | None,
            seed: int | None, dsn: str | None, json_path: str | None,
            faults: frozenset[str], lease: float, slack: float, fault_spacing: float,
            keep_logs: bool, groups: int, targets: int,
            limits: dict[str, Limit] | None, failover_lag: float,
            wait_for_replicas: bool) -> None:
    """Drain jobs through dispatchers that are killed, frozen and cut off, against
    providers that fail, and check that every effect happened once and none was lost.

    Exits 1 on any violation. The seed is printed; --seed replays the same jobs and
    fault schedule (not the same timing).
    """
    try:  # the runner drives NATS and Kafka brokers too: outbox-pg[chaos]
        from .runner import run_chaos
    except ModuleNotFoundError as exc:
        raise click.ClickException(
            f"outbox chaos needs {(exc.name or 'nats').partition('.')[0]}, which is not "
            "installed: pip install 'outbox-pg[chaos]'") from None
    seed = seed if seed is not None else random.SystemRandom().randrange(1 << 31)
    try:
        config = ChaosConfig(workers=workers, jobs=jobs, duration=duration,
                             deadline=deadline if deadline is not None else duration + 200,
                             seed=seed, dsn=dsn, faults=faults, lease=lease, slack=slack,
                             fault_spacing=fault_spacing, keep_logs=keep_logs,
                             groups=groups, limits=limits, targets=targets,
                             failover_lag=failover_lag, wait_for_replicas=wait_for_replicas)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    console = Console(stderr=False)
    console.print(f"[bold]outbox chaos[/]: seed {seed} (replay with --seed {seed})")
    # A SIGTERM (a timeout, an orchestrator) ends the run as Ctrl-C does: its workers,
    # servers and database are cleaned up, not left running without their runner.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    report = run_chaos(config, progress=lambda line: console.print(f"  {line}", markup=False))
    report.print(console)
    if json_path:
        report.write_json(json_path)
        console.print(f"report written to {json_path}")
    sys.exit(0 if report.ok else 1)
