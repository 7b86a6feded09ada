-- The inbox: one row per message an idempotent consumer has handled, written in the
-- transaction that handles it (tx.receive), so a redelivered message is recognised and
-- skipped. Rows are purged after a retention period (purge_inbox), oldest first.

CREATE TABLE {schema}.inbox (
    consumer    text        NOT NULL CHECK (length(consumer) BETWEEN 1 AND 255),
    message_id  text        NOT NULL CHECK (length(message_id) BETWEEN 1 AND 255),
    received_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);

-- Serves retention.
CREATE INDEX inbox_received ON {schema}.inbox (received_at);
