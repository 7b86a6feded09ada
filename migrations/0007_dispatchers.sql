-- The running dispatchers: each records which effects it serves and refreshes its row
-- (a heartbeat) while it runs, so `outbox status`, the metrics and the dispatchers
-- themselves can tell due jobs that no running dispatcher will ever claim (an effect
-- name with a typo, a dispatcher not deployed) from a backlog being worked on. A row
-- whose heartbeat stopped (the process died) counts until expires_at, then is ignored
-- and eventually deleted by another dispatcher's heartbeat.

CREATE TABLE {schema}.dispatchers (
    worker_id    text        PRIMARY KEY CHECK (length(worker_id) BETWEEN 1 AND 255),
    effects      text[]      NOT NULL,
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now(),
    expires_at   timestamptz NOT NULL
);
