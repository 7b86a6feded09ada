"""What a chaos worker process is told: its settings, passed as JSON in the environment.

Kept apart from ``effects.chaos.worker`` so that the runner can build settings without
importing the worker module (which runs as ``__main__`` in the worker process).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["ENV_VARIABLE", "ROLES", "WorkerSettings", "application_name"]

ENV_VARIABLE = "OUTBOX_CHAOS_WORKER"
# The dispatcher's connections; each is named "outbox <role> <tag>" in a chaos worker.
# A fleet's look-outs ("scout") are dispatcher connections too: the terminate fault cuts
# them as it cuts the others.
ROLES = ("claimer", "recorder", "listener", "scout")


@dataclass(frozen=True)
class WorkerSettings:
    """Everything a worker process needs, passed as JSON in ``$OUTBOX_CHAOS_WORKER``.

    ``tag`` identifies the process: it is the dispatcher's ``worker_id`` (so the jobs'
    ``claimed_by``) and the suffix of its connections' ``application_name``. ``limits``
    maps an effect to the fields of the ``outbox.Limit`` the dispatcher declares for it.
    ``view`` is the schema of views over every target (the audit reads the jobs there).
    ``targets``, when given, are the outbox schemas one fleet dispatcher serves instead
    of a dispatcher of ``schema`` alone; such a worker writes ``ready_file`` once a
    SIGTERM would stop its dispatcher gracefully (a fleet holds no connection of its
    own that the runner could see, only its turns').
    """

    dsn: str
    schema: str
    chaos: str
    tag: str
    email_url: str
    stripe_url: str
    webhook_url: str
    webhook_secret: str
    nats_url: str
    nats_stream: str
    kafka_bootstrap: str
    kafka_topic: str
    lease: float
    rescue_interval: float
    concurrency: int
    provider_timeout: float
    backoff_base: float = 0.05
    backoff_cap: float = 0.5
    # The dispatcher's stop_timeout: after SIGTERM, performs in flight get this long,
    # then run() returns and the jobs still held are left to their leases.
    stop_timeout: float = 10.0
    limits: dict[str, dict[str, Any]] = field(default_factory=dict)
    view: str = ""
    targets: list[str] = field(default_factory=list)
    ready_file: str = ""
    # The dispatcher's wait_for_replicas (a run with the failover fault): a claimed job
    # is performed only once the streaming standby has its commit.
    wait_for_replicas: bool = False

    def to_json(self) -> str:
        """The settings as the JSON the worker reads."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSettings:
        """Settings from ``to_json``'s output."""
        return cls(**json.loads(text))

    def application_names(self) -> list[str]:
        """The ``application_name`` of each dispatcher connection of this worker."""
        return [application_name(role, self.tag) for role in ROLES]


def application_name(role: str, tag: str) -> str:
    """``outbox <role> <tag>``: starts with "outbox " like every dispatcher connection."""
    return f"outbox {role} {tag}"[:63]
