"""CloudEvents 1.0 in binary content mode: the event's attributes as message headers.

The adapters that take ``envelope="cloudevents"`` (``nats.publish``, ``kafka.produce``,
``webhook.post``) keep their body as the event's data (JSON, ``datacontenttype``
``application/json``) and add, with the binding's prefix (``ce-`` for HTTP and NATS,
``ce_`` for Kafka)::

    id            the job's key: the same on every attempt, so receivers dedupe on it
    source        the adapter's ``source`` (a URI-reference, "/outbox" by default)
    type          the payload's ``type``, else the subject / topic / webhook event
    time          the job's first attempt (RFC 3339, UTC): the same on every attempt;
                  absent for a job never claimed (a hand-built one)
    specversion   1.0
"""

from __future__ import annotations

from datetime import UTC
from typing import Literal

from outbox import Job

__all__ = ["Envelope", "attributes", "check_envelope"]

Envelope = Literal["cloudevents"] | None
SPECVERSION = "1.0"


def check_envelope(envelope: str | None, source: str) -> None:
    """Refuse an unknown envelope or an empty source, at construction."""
    if envelope not in (None, "cloudevents"):
        raise ValueError(f"envelope must be None or 'cloudevents', got {envelope!r}")
    if not source or any(c in source for c in "\r\n"):
        raise ValueError("source must be a non-empty URI-reference on one line")


def attributes(job: Job, *, source: str, type_: str, prefix: str) -> dict[str, str]:
    """The event's context attributes as headers named ``<prefix><attribute>``."""
    found = {"id": job.key, "source": source, "type": type_, "specversion": SPECVERSION}
    if job.first_attempted_at is not None:
        found["time"] = job.first_attempted_at.astimezone(UTC).isoformat(
            timespec="microseconds")
    return {prefix + name: value for name, value in found.items()}
