"""Migration claim_rank_inline on a live schema: it waits for no lock an open enqueue or
claim holds (the function's new body and the index's refreshed definition take none of
theirs), so business transactions and dispatchers run through it."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

import outbox
from outbox.migrate import migrations
from outbox.sql import bind_schema

from .helpers import schema_at

INLINED = next(m.version for m in migrations() if m.name.endswith("claim_rank_inline"))


@pytest.fixture
def before_inline(dsn: str) -> Iterator[str]:
    """A schema migrated up to the version before claim_rank_inline."""
    with schema_at(dsn, INLINED - 1, "rank") as name:
        yield name


def test_the_migration_waits_for_no_open_enqueue_or_claim(
        dsn: str, before_inline: str, caplog: pytest.LogCaptureFixture) -> None:
    # A business transaction that enqueued (its row in jobs_fair, not committed) and one
    # that claimed stay open throughout: the run takes no lock either of them holds off.
    with psycopg.connect(dsn) as business, psycopg.connect(dsn) as claiming:
        business.execute("SELECT 1")  # the business's own transaction, begun
        with outbox.transaction(business, schema=before_inline) as tx:
            tx.enqueue("test.work", key="open", payload={}, group="g")
        claiming.execute(bind_schema(
            "SELECT id FROM {schema}.jobs WHERE status = 'pending' FOR UPDATE",
            before_inline).encode())
        assert business.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        with psycopg.connect(dsn, autocommit=True) as migrating:
            # This migration alone: a later one may wait for its lock (0021 alters jobs).
            assert outbox.migrate(migrating, schema=before_inline, lock_timeout=0.2,
                                  target=INLINED) == [INLINED]
    assert not [r for r in caplog.records if "not granted" in r.getMessage()]
