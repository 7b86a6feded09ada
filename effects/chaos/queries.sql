-- The chaos runner's statements, as named blocks. {schema} is the outbox schema and
-- {chaos} the runner's own schema (the audit and the business rows), both substituted
-- as quoted identifiers; values are bound parameters, by name.

-- name: create_tables
-- deliveries: one row per call of an adapter, written by the worker BEFORE the provider
-- is called (its own autocommit connection), its outcome filled in afterwards. Two
-- workers with one (key, claim_version) is a double claim. call_id makes the worker's
-- own retry of the insert idempotent, so a repeat means two calls, never one retried.
CREATE TABLE {chaos}.deliveries (
    call_id       uuid        PRIMARY KEY,
    key           text        NOT NULL,
    claim_version bigint      NOT NULL,
    worker        text        NOT NULL,
    attempt       integer     NOT NULL,
    started_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    outcome       text,
    finished_at   timestamptz
);
CREATE INDEX deliveries_claim ON {chaos}.deliveries (key, claim_version);
-- orders: the business row each enqueue transaction writes next to its jobs.
CREATE TABLE {chaos}.orders (
    batch      text        PRIMARY KEY,
    jobs       integer     NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

-- name: delivery_begin
INSERT INTO {chaos}.deliveries (call_id, key, claim_version, worker, attempt)
VALUES (%(call_id)s::uuid, %(key)s::text, %(claim_version)s::bigint, %(worker)s::text,
        %(attempt)s::integer)
ON CONFLICT (call_id) DO NOTHING;

-- name: delivery_end
UPDATE {chaos}.deliveries
SET outcome = %(outcome)s::text, finished_at = clock_timestamp()
WHERE call_id = %(call_id)s::uuid;

-- name: insert_order
INSERT INTO {chaos}.orders (batch, jobs) VALUES (%(batch)s::text, %(jobs)s::integer)
ON CONFLICT (batch) DO NOTHING;

-- name: lease_overrun
-- The running job furthest past its lease, and by how many seconds.
SELECT extract(epoch FROM now() - lease_until)::float8, key
FROM {schema}.jobs
WHERE status = 'running' AND lease_until < now()
ORDER BY lease_until
LIMIT 1;

-- name: schema_storage
-- Bytes on disk of every relation of the outbox schema (tables with their indexes and
-- TOAST; a partitioned parent counts 0, its partitions count themselves).
SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0)::bigint
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = %(schema)s::text AND c.relkind IN ('r', 'm');

-- name: status_counts
SELECT status, count(*)::int FROM {schema}.jobs GROUP BY status;

-- name: worker_backends
-- The backends of the dispatcher connections named in %(names)s (one worker's).
SELECT pid, application_name, state, query_start, wait_event_type, left(query, 40)
FROM pg_stat_activity
WHERE datname = current_database() AND application_name = ANY(%(names)s::text[]);

-- name: lock_timeout
SET LOCAL lock_timeout = '200ms';

-- name: lock_jobs_table
-- Blocks every write to the jobs table (claims included) until this transaction ends;
-- reads go on. Held for at most a second, to catch a claim statement in flight.
LOCK TABLE {schema}.jobs IN SHARE MODE;

-- name: lock_recorded_jobs
-- Row-lock the jobs a worker holds whose provider call ended well under this claim: its
-- next completion statement will wait on them, in flight, until this transaction ends.
SELECT j.id
FROM {schema}.jobs j
WHERE j.status = 'running' AND j.claimed_by = %(worker)s::text
  AND EXISTS (SELECT 1 FROM {chaos}.deliveries d
              WHERE d.key = j.key AND d.claim_version = j.claim_version
                AND d.worker = %(worker)s::text AND d.outcome = 'ok')
FOR UPDATE OF j SKIP LOCKED;

-- name: terminate_backends
SELECT count(*) FILTER (WHERE pg_terminate_backend(pid))::int
FROM pg_stat_activity
WHERE datname = current_database() AND application_name LIKE 'outbox %%'
  AND application_name = ANY(%(names)s::text[]);

-- name: held_jobs
-- The jobs a worker holds, and for each whether that worker has called the provider
-- under this claim (a deliveries row for this claim_version).
SELECT j.key, j.effect, j.claim_version,
       EXISTS (SELECT 1 FROM {chaos}.deliveries d
               WHERE d.key = j.key AND d.claim_version = j.claim_version
                 AND d.worker = %(worker)s::text) AS called
FROM {schema}.jobs j
WHERE j.status = 'running' AND j.claimed_by = %(worker)s::text;

-- name: final_jobs
SELECT j.id, j.key, j.effect, j.status, j.attempts, j.claim_version, j.last_error,
       r.job_id, r.claim_version, r.result
FROM {schema}.jobs j
LEFT JOIN {schema}.effect_results r ON r.key = j.key
ORDER BY j.id;

-- name: orphan_ledger_rows
-- Ledger rows without a job (a job row is never deleted during a run: retention is off).
SELECT r.key FROM {schema}.effect_results r
WHERE NOT EXISTS (SELECT 1 FROM {schema}.jobs j WHERE j.key = r.key);

-- name: repeated_claims
-- (key, claim_version) pairs delivered more than once: by several workers (a double
-- claim) or several times by one worker (a repeat under one claim).
SELECT key, claim_version, count(DISTINCT worker)::int AS workers, count(*)::int AS calls
FROM {chaos}.deliveries
GROUP BY key, claim_version
HAVING count(*) > 1;

-- name: outcomes
-- What the adapters experienced, one row per call that finished.
SELECT key, outcome FROM {chaos}.deliveries WHERE outcome IS NOT NULL;

-- name: order_names
SELECT batch FROM {chaos}.orders;

-- name: throughput
-- Finished jobs, and seconds from the first enqueue to the last finish.
SELECT count(*)::int,
       coalesce(extract(epoch FROM max(updated_at) - min(created_at)), 0)::float8
FROM {schema}.jobs
WHERE status IN ('done', 'failed', 'reconcile');

-- Events: what the chaos consumers handled, one row per handling (no key: a message
-- handled twice shows as two rows, which the checks count). source: nats or kafka;
-- subject: the NATS subject, or the Kafka message's partition:offset.

-- name: create_consumed
CREATE TABLE {chaos}.consumed (
    message_id  text        NOT NULL,
    source      text        NOT NULL,
    subject     text        NOT NULL,
    handled_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- name: consumed_insert
INSERT INTO {chaos}.consumed (message_id, source, subject)
VALUES (%(message_id)s, %(source)s, %(subject)s);

-- name: consumed_counts
SELECT source, message_id, count(*)::int FROM {chaos}.consumed GROUP BY 1, 2;

-- name: kafka_attempts
-- Every audited call of a kafka.produce job: how it ended (NULL: the worker died or was
-- cut off before it recorded that), under which claim, and the job's final claim.
SELECT d.key, d.claim_version, d.outcome, j.claim_version, j.status
FROM {chaos}.deliveries d
JOIN {schema}.jobs j ON j.key = d.key
WHERE j.effect = 'kafka.produce';
