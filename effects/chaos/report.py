"""The report of a chaos run: figures, violations, a table for people and JSON for tools.

What the figures mean:

- ``jobs``: ``planned`` committed jobs, ``committed`` rows found in the jobs table,
  ``done`` / ``failed`` / ``reconcile`` final states, ``lost`` committed jobs in none of
  them by the deadline (must be 0), ``rolled_back`` jobs of business transactions that
  rolled back (must never exist nor be performed).
- ``targets``: per outbox schema (one per target, ``--targets``): its ``committed``
  jobs, ``done`` / ``failed`` / ``reconcile``, ``lost`` and ``twice`` (jobs performed
  more than once by an effect meant to happen once); both must be 0 in every target.
  ``workers`` then also counts the worker processes that called providers for jobs of
  several targets (``served_several_targets``: a fleet) and of one only.
- ``faults``: per kind, ``armed`` (events carried out; for provider faults the number of
  requests armed to fail) and ``injected``: evidence the fault took effect. Kills sent,
  stops that outlasted the lease, restarts completed, terminate rounds that ended a
  backend, requests slowed by a latency spike; for 5xx, 429, timeout and drop the
  adapter calls whose outcome shows the fault (for timeout at least the answers the
  fakes withheld: a worker killed meanwhile never sees its timeout), for decline the
  jobs failed by a declined card. An enabled kind with nothing injected fails the
  run: a schedule that injected nothing proves nothing.
- ``windows``: per failure window (``schedule.KILL_WINDOWS``), the kills aimed at it, those that saw
  the worker in it just before the kill, the kills that hit it (judged after the kill)
  and the jobs or statements caught in it (see ``effects.chaos.windows``); the
  ``anytime`` row counts plain kills, those that hit any window and the jobs they left.
- ``lease``: ``max_overrun`` the longest a job was seen ``running`` past its lease
  (sampled every ~100 ms), ``bound`` = lease + rescue interval + slack, which it must
  not exceed.
- ``running``: under a concurrency limit (``--limit``, or the defaults of a run with
  ``--groups``), per effect the ``most`` running jobs of one group seen at once (of the
  whole effect when the limit is not per group), sampled with the lease every ~100 ms
  in one snapshot each, against the ``limit``, which it must not exceed
  (``samples_over`` counts the samples above it: ``concurrency_exceeded``, as are
  more provider calls of a group in flight under live claims than the limit, found
  in the audit: ``groups["calls_in_flight"]``).
- ``groups``: a run with groups: how the jobs were spread (the heavy group, the others,
  none), the priorities, the limits the workers declared, and figures read from the
  audit and the jobs once the run drained (see ``effects.chaos.groups``).
- ``workers``: processes started, killed, and the ``DispatchStats`` summed over those
  that exited on SIGTERM (killed workers print none): ``stale_completions`` are fenced
  late writes (0 rows), ``lost_claims`` claims a heartbeat found gone.
- ``storage_bytes``: the outbox schema's relations on disk once the run drained
  (``pg_total_relation_size`` summed; None if the server could not be reached).
- ``throughput``: jobs that ended per second, from the first enqueue to the last end.
  The trickle paces the later jobs over the chaos phase, so this is the rate the run
  sustained under its faults, not the dispatchers' ceiling.
- ``events``: the NATS half: job keys with a message in the stream (``keys``), the
  messages stored (``messages``, must equal ``keys``), the most stored for one key
  (``max_per_key``, must be at most 1), the consumer's handlings (``handled``, must
  equal ``messages``), redeliveries the inbox skipped, handler retries (a database or
  broker away), messages parked, broker restarts.
- ``kafka``: the Kafka half, counted per job key from the topic's ``outbox-key``
  headers: ``keys`` with a message, ``messages`` stored, ``keys_repeated`` (more than
  one message: at least once allows it), ``max_per_key``, ``keys_per_count`` (how many
  keys hold 1, 2, ... messages), ``stored_again`` (copies of one batch, same partition
  and producer timestamp: the mock cluster storing a producer's retry that a broker would
  have dropped as a duplicate), ``acked_not_done`` (attempts the broker acknowledged
  whose ``done`` was never recorded under that claim: where repeats come from),
  ``handled`` by the consumer (must equal ``keys``), repeats its inbox skipped and
  handler retries (counted by the consumer process that stopped last), messages parked,
  consumer kills and freezes, brokers set down.
- ``failover``: a run with the opt-in ``failover`` fault: ``at`` (seconds into the
  chaos phase) the primary was killed for good and the standby promoted, in
  ``seconds``; ``old_primary`` / ``new_primary``, and ``checked_on``: the node the
  checks read (the promoted standby, out of recovery, or the failover did not happen).
  What it cost: ``lost_orders`` (acknowledged orders the new primary lacks: asynchronous
  replication allows it) and their ``lost_order_jobs``, reported, not violations;
  ``phantoms``, effects performed for jobs the new primary lacks (must be 0: a
  violation); ``handlings_lost`` and ``kafka_repeats_unaudited`` (see
  ``effects.chaos.checks``: what the checks judge only on the new primary's rows).
- ``violations``: each invariant broken, with examples; the run passes when empty.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["ChaosReport"]


@dataclass
class ChaosReport:
    """The outcome of ``run_chaos``; ``ok`` when no invariant was violated."""

    seed: int
    settings: dict[str, Any]
    database: str
    elapsed_seconds: float
    jobs: dict[str, int]
    per_effect: dict[str, dict[str, int]]
    failed_reasons: dict[str, int]
    reconcile_reasons: dict[str, int]
    providers: dict[str, dict[str, int]]
    outcomes: dict[str, int]
    faults: dict[str, dict[str, int]]
    windows: dict[str, dict[str, int]]
    kills: list[dict[str, Any]]
    workers: dict[str, int]
    lease: dict[str, Any]
    throughput: float
    violations: dict[str, list[str]]
    violation_counts: dict[str, int]
    events: dict[str, int] = field(default_factory=dict)
    kafka: dict[str, Any] = field(default_factory=dict)
    running: dict[str, Any] = field(default_factory=dict)
    groups: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    log_dir: str | None = None
    storage_bytes: int | None = None
    targets: dict[str, dict[str, int]] = field(default_factory=dict)
    failover: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when no invariant was violated: in particular no job lost and none
        performed twice, in every target."""
        return not self.violations and all(
            counts.get("lost", 0) == 0 and counts.get("twice", 0) == 0
            for counts in self.targets.values())

    def as_dict(self) -> dict[str, Any]:
        """The report as plain JSON-ready data (with ``ok``)."""
        return {"ok": self.ok, **asdict(self)}

    def write_json(self, path: str | Path) -> None:
        """Write ``as_dict()`` to ``path`` as indented JSON."""
        Path(path).write_text(json.dumps(self.as_dict(), indent=2, default=str) + "\n")

    def print(self, console: Console) -> None:
        """Print the report as tables."""
        console.print(self._summary())
        console.print(self._fault_table())
        console.print(self._window_table())
        if self.groups:
            console.print(self._group_table())
        if self.failed_reasons or self.reconcile_reasons:
            console.print(self._reason_table())
        for note in self.notes:
            console.print(f"note: {note}")
        self._print_verdict(console)

    def _summary(self) -> Table:
        table = Table(title=f"outbox chaos: seed {self.seed}, {self.database}")
        table.add_column("figure")
        table.add_column("value", justify="right")
        table.add_column("must be", justify="right")
        for name, value in self.jobs.items():
            table.add_row(f"jobs {name}", str(value), "0" if name == "lost" else "")
        if len(self.targets) > 1:
            for target, counts in self.targets.items():
                table.add_row(f"  target {target}", _pairs(counts), "lost 0, twice 0")
        for name in ("performed_twice", "double_claims", "repeated_deliveries",
                     "ledger_missing", "ledger_not_done", "ledger_version_mismatch",
                     "ledger_result_mismatch", "done_not_once", "decline_mismatches",
                     "unexpected_failures", "missing_jobs", "rolled_back_present",
                     "consumed_not_once", "dead_lettered", "kafka_missing",
                     "kafka_unexplained_repeats", "phantoms"):
            table.add_row(name.replace("_", " "), str(self.violation_counts.get(name, 0)), "0")
        overrun = f"{self.lease['max_overrun']:.2f} s"
        table.add_row("longest running past lease", overrun, f"<= {self.lease['bound']:.1f} s")
        for effect, most in sorted(self.running.get("most", {}).items()):
            per_group = str(self.settings.get("limits", {}).get(effect, "")).endswith(
                "per_group")
            table.add_row(f"most running{' of one group' if per_group else ''}, {effect}",
                          str(most), f"<= {self.running['limit'][effect]}")
        table.add_row("throughput", f"{self.throughput:.1f} jobs/s", "")
        for effect, counts in sorted(self.per_effect.items()):
            table.add_row(f"  {effect}", _pairs(counts), "")
        for name, counts in self.providers.items():
            table.add_row(f"  fake {name}", _pairs(counts), "")
        table.add_row("adapter outcomes", _pairs(self.outcomes), "")
        if self.events:
            table.add_row("events (NATS)", _pairs(self.events), "max_per_key <= 1")
        if self.kafka:
            table.add_row("events (Kafka)", _pairs(self.kafka), "handled = keys")
        if self.failover:
            table.add_row("failover", _pairs({k: v for k, v in self.failover.items()
                                              if k != "lost_order_examples"}),
                          "phantoms 0")
        table.add_row("workers", _pairs(self.workers), "")
        table.add_row("elapsed", f"{self.elapsed_seconds:.1f} s", "")
        if self.storage_bytes is not None:
            table.add_row("storage at the end", f"{self.storage_bytes / 2**20:.1f} MiB", "")
        return table

    def _fault_table(self) -> Table:
        table = Table(title="faults")
        for column in ("kind", "armed", "injected"):
            table.add_column(column, justify="left" if column == "kind" else "right")
        for kind, counts in self.faults.items():
            table.add_row(kind, str(counts["armed"]), str(counts["injected"]))
        return table

    def _group_table(self) -> Table:
        groups = self.groups
        table = Table(title=f"groups: {groups['groups']}, the heavy one "
                            f"{groups['heavy_group']}")
        table.add_column("figure")
        table.add_column("value")
        table.add_row("jobs", _pairs(groups["jobs"]))
        table.add_row("priorities (jobs)", _pairs(groups["priorities"]))
        table.add_row("limits", _pairs(groups["limits"]))
        for effect, figure in groups.get("calls_in_flight", {}).items():
            table.add_row(f"most calls of one group in flight, {effect}",
                          f"{figure['most']} (group {figure['group']!r}, limit "
                          f"{figure['limit']}; groups above it {figure['groups_over_limit']}; "
                          f"calls counted {figure['calls_counted']}, left out: begun outside "
                          f"their claim {figure['begun_outside_claim']}, claim ended during "
                          f"{figure['claim_ended_during']}, end unrecorded "
                          f"{figure['end_unrecorded']})")
        for effect, figure in groups.get("calls_per_window", {}).items():
            table.add_row(f"most calls of one group begun in {figure['window']} s, {effect}",
                          f"{figure['most']} (group {figure['group']!r}; its bucket admits "
                          f"{figure['bucket_admits']:g} claims in as long)")
        for kind, figure in groups.get("seconds_to_end", {}).items():
            table.add_row(f"seconds to end, {kind}", _pairs(figure))
        if "unreadable" in groups:
            table.add_row("not read", groups["unreadable"])
        return table

    def _window_table(self) -> Table:
        table = Table(title="failure windows: kills aimed, worker seen in it before the "
                            "kill, kills that hit it, jobs or statements caught")
        table.add_column("window", no_wrap=True)
        for column in ("aimed", "seen", "hit", "caught"):
            table.add_column(column, justify="right")
        for window, counts in self.windows.items():
            table.add_row(window, *(str(counts[name]) for name in ("aimed", "seen", "kills",
                                                                  "caught")))
        return table

    def _reason_table(self) -> Table:
        table = Table(title="failed and reconcile jobs, by reason")
        table.add_column("status")
        table.add_column("jobs", justify="right")
        table.add_column("reason")
        for status, reasons in (("failed", self.failed_reasons),
                                ("reconcile", self.reconcile_reasons)):
            for reason, count in sorted(reasons.items(), key=lambda item: -item[1]):
                table.add_row(status, str(count), reason)
        return table

    def _print_verdict(self, console: Console) -> None:
        if self.ok:
            console.print("[bold green]no violation[/]: every job ended, none performed twice, "
                          "no double claim, ledger consistent, every enabled fault injected")
            return
        console.print(f"[bold red]{sum(self.violation_counts.values())} violation(s)[/]:")
        for name, examples in self.violations.items():
            console.print(f"  [bold]{name}[/] ({self.violation_counts.get(name, 0)}):")
            for example in examples:
                console.print(f"    {example}", markup=False)
        if self.log_dir:
            console.print(f"worker logs kept in {self.log_dir}")


def _pairs(counts: dict[str, Any]) -> str:
    return ", ".join(f"{name} {value}" for name, value in counts.items())
