-- Kafka consumer offsets kept in PostgreSQL: the next offset to read per consumer group,
-- topic and partition, written in the same transaction as the handler's writes and the
-- inbox rows, so a consumer that dies after that commit resumes exactly after what it
-- committed (effects.kafka.InboxConsumer seeks here on assignment).

CREATE TABLE {schema}.kafka_offsets (
    consumer    text        NOT NULL CHECK (length(consumer) BETWEEN 1 AND 255),
    topic       text        NOT NULL CHECK (length(topic) BETWEEN 1 AND 249),
    partition   integer     NOT NULL CHECK (partition >= 0),
    next_offset bigint      NOT NULL CHECK (next_offset >= 0),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, topic, partition)
);
