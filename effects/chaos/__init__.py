"""effects.chaos: the chaos conformance runner (``outbox chaos``).

It drains thousands of mixed jobs (``email.send``, ``payment.charge``, ``webhook.post``)
through real dispatcher processes pointed at the fake providers of ``effects.testing``
while a seeded fault schedule kills (SIGKILL) and freezes (SIGSTOP past the lease)
dispatchers, restarts PostgreSQL, terminates dispatcher connections and makes the
providers fail (5xx, 429 with Retry-After, latency spikes, success then timeout, dropped
connections, declined cards). With ``--groups`` the jobs belong to tenants (one heavy),
some carry a priority, and the workers declare limits per group. The opt-in
``failover`` fault (``--faults failover,...``) runs the database as a primary and its
streaming standby, kills the primary for good mid-run and promotes the standby; the
checks then judge what the new primary holds and count the effects performed for
orders it lost (phantoms: none with ``wait_for_replicas``). Then it checks the
guarantees outbox states (docs/explanation/guarantees.md)::

    nothing lost              every committed job ends done, failed or reconcile
    once at the provider      no key performed twice by any fake; done jobs once
    no double claim           no (key, claim_version) delivered by two workers
    ledger = done             ledger rows exactly for done jobs, same claim_version
    bounded leases            no job running past lease + rescue interval + slack
    bounded concurrency       never more running jobs of a group than its Limit allows
    permanent is final        declined cards end failed, with their decline code
    faults happened           every enabled fault kind was injected at least once
    no phantom                no effect performed for a job the database lacks

``run_chaos(ChaosConfig(...))`` returns a ``ChaosReport`` (``report.ok``; the figures
are described in ``effects.chaos.report``); ``command`` is the click command that
``outbox chaos`` and ``python -m effects.chaos`` run.
"""

from typing import TYPE_CHECKING, Any

from .cli import command
from .config import ChaosConfig, parse_faults
from .report import ChaosReport

if TYPE_CHECKING:
    from .runner import run_chaos


def __getattr__(name: str) -> Any:
    # The runner needs nats-py and confluent-kafka (outbox-pg[chaos]); loaded on first
    # use, so that `outbox --help` lists `outbox chaos` wherever the extra is missing.
    if name == "run_chaos":
        from .runner import run_chaos

        return run_chaos
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["ChaosConfig", "ChaosReport", "command", "parse_faults", "run_chaos"]
