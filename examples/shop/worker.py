"""The shop's dispatcher, for ``outbox run examples.shop.worker:dispatcher`` (one process
each; the demo starts its dispatchers so, and ``outbox run`` prints each one's counters
as JSON on stderr when SIGTERM stops it)."""

from __future__ import annotations

from examples.shop.app import dispatcher

__all__ = ["dispatcher"]
