-- The chaos runner's statements, as named blocks. {schema} is the schema of views over
-- every target's outbox (effects.chaos.database: jobs and effect_results, each row with
-- its target), except in lock_jobs_table and lock_recorded_jobs, which lock and so are
-- run against each target's own outbox schema; {chaos} is the runner's own schema (the
-- audit and the business rows). Both are substituted as quoted identifiers; values are
-- bound parameters, by name.

-- name: create_tables
-- deliveries: one row per call of an adapter, written by the worker BEFORE the provider
-- is called (its own autocommit connection), its outcome filled in afterwards. Two
-- workers with one (key, claim_version) is a double claim. call_id makes the worker's
-- own retry of the insert idempotent, so a repeat means two calls, never one retried.
-- live_begin and live_end: whether the job was still running under the call's claim
-- when the call began and when it ended (a claim never comes back once it has ended, so
-- both mean the claim lasted the whole call, and a limit counted it meanwhile).
CREATE TABLE {chaos}.deliveries (
    call_id       uuid        PRIMARY KEY,
    key           text        NOT NULL,
    claim_version bigint      NOT NULL,
    worker        text        NOT NULL,
    attempt       integer     NOT NULL,
    effect        text        NOT NULL,
    group_key     text,
    started_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    live_begin    boolean     NOT NULL,
    outcome       text,
    finished_at   timestamptz,
    live_end      boolean
);
CREATE INDEX deliveries_claim ON {chaos}.deliveries (key, claim_version);
-- orders: the business row each enqueue transaction writes next to its jobs.
CREATE TABLE {chaos}.orders (
    batch      text        PRIMARY KEY,
    jobs       integer     NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

-- name: delivery_begin
INSERT INTO {chaos}.deliveries (call_id, key, claim_version, worker, attempt, effect,
                                group_key, live_begin)
SELECT %(call_id)s::uuid, %(key)s::text, %(claim_version)s::bigint, %(worker)s::text,
       %(attempt)s::integer, %(effect)s::text, %(group_key)s::text,
       EXISTS (SELECT 1 FROM {schema}.jobs j
               WHERE j.key = %(key)s::text AND j.status = 'running'
                 AND j.claim_version = %(claim_version)s::bigint)
ON CONFLICT (call_id) DO NOTHING;

-- name: delivery_end
UPDATE {chaos}.deliveries d
SET outcome = %(outcome)s::text, finished_at = clock_timestamp(),
    live_end = EXISTS (SELECT 1 FROM {schema}.jobs j
                       WHERE j.key = d.key AND j.status = 'running'
                         AND j.claim_version = d.claim_version)
WHERE d.call_id = %(call_id)s::uuid;

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
-- Bytes on disk of every relation of the outbox schemas in %(schemas)s (tables with
-- their indexes and TOAST; a partitioned parent counts 0, its partitions count
-- themselves).
SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0)::bigint
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = ANY(%(schemas)s::text[]) AND c.relkind IN ('r', 'm');

-- name: running_per_group
-- The running jobs of each group of the effects in %(effects)s, with their keys, per
-- target: a concurrency (per group or for the whole effect) counts these at each claim,
-- in its target's own tables. Served by the partial index jobs_leases (status =
-- 'running'): a few dozen rows.
SELECT effect, coalesce(group_key, ''), count(*)::int, array_agg(key ORDER BY key), target
FROM {schema}.jobs
WHERE status = 'running' AND effect = ANY(%(effects)s::text[])
GROUP BY effect, coalesce(group_key, ''), target;

-- name: calls_in_flight
-- Per group of each effect in %(effects)s (g NULL for the effects in %(whole)s, counted
-- as a whole), from the audit: the most provider calls in flight at once under claims
-- that lasted the whole call (live_begin and live_end), with the instant the most were
-- reached; the calls so counted, and those left out: begun outside their claim (a
-- worker frozen past its lease, then thawed), whose claim ended during the call (its
-- lease lost), or whose end was never recorded (the worker killed or cut off). A call
-- counts from its begin to its end; at equal times an end counts before a begin. Per
-- target (a limit is counted in its target's own tables), the call's target being its
-- job's (keys are unique over the targets).
WITH calls AS (
    SELECT d.*, j.target, CASE WHEN d.effect = ANY(%(whole)s::text[]) THEN NULL
                               ELSE coalesce(d.group_key, '') END AS g,
           d.live_begin AND coalesce(d.live_end, false) AS counted
    FROM {chaos}.deliveries d
    JOIN {schema}.jobs j ON j.key = d.key
    WHERE d.effect = ANY(%(effects)s::text[])
), edges AS (
    SELECT c.effect, c.target, c.g, e.at, e.delta
    FROM calls c
    CROSS JOIN LATERAL (VALUES (c.started_at, 1), (c.finished_at, -1)) AS e(at, delta)
    WHERE c.counted
), counted AS (
    SELECT effect, target, g, at,
           sum(delta) OVER (PARTITION BY effect, target, g ORDER BY at, delta
                            ROWS UNBOUNDED PRECEDING) AS n
    FROM edges
), most AS (
    SELECT DISTINCT ON (effect, target, g) effect, target, g, n::int, at
    FROM counted
    ORDER BY effect, target, g, n DESC, at
), tallies AS (
    SELECT effect, target, g,
           count(*) FILTER (WHERE counted)::int AS counted,
           count(*) FILTER (WHERE NOT live_begin)::int AS outside,
           count(*) FILTER (WHERE live_begin AND NOT live_end)::int AS outlived,
           count(*) FILTER (WHERE live_begin AND live_end IS NULL)::int AS unended
    FROM calls
    GROUP BY effect, target, g
)
SELECT t.effect, t.g, coalesce(m.n, 0), m.at, t.counted, t.outside, t.outlived, t.unended,
       t.target
FROM tallies t
LEFT JOIN most m ON m.effect = t.effect AND m.target = t.target
                AND m.g IS NOT DISTINCT FROM t.g;

-- name: calls_at
-- The calls of one group of an effect (%(g)s NULL: any) in one target in flight at an
-- instant, as calls_in_flight counts them, with the claim and status their job ended
-- with.
SELECT d.key, d.claim_version, d.worker, d.started_at, d.finished_at, d.outcome,
       j.claim_version, j.status
FROM {chaos}.deliveries d
JOIN {schema}.jobs j ON j.key = d.key
WHERE d.effect = %(effect)s::text AND j.target = %(target)s::text
  AND (%(g)s::text IS NULL OR coalesce(d.group_key, '') = %(g)s::text)
  AND d.live_begin AND d.live_end
  AND d.started_at <= %(at)s::timestamptz AND d.finished_at > %(at)s::timestamptz
ORDER BY d.started_at;

-- name: calls_per_window
-- The most calls of one group of an effect begun within ten seconds, from the audit,
-- counting the calls begun under a live claim (a worker frozen past its lease performs
-- the claims it held when it thaws, claims whose tokens were spent long before); g is
-- NULL for the effects in %(whole)s, counted as a whole. Per target, like
-- calls_in_flight.
SELECT DISTINCT ON (effect, target, g) effect, g, n::int, target
FROM (
    SELECT effect, target, g,
           count(*) OVER (PARTITION BY effect, target, g ORDER BY started_at
                          RANGE BETWEEN CURRENT ROW
                                    AND interval '9999 milliseconds' FOLLOWING) AS n
    FROM (SELECT d.effect, d.started_at, j.target,
                 CASE WHEN d.effect = ANY(%(whole)s::text[]) THEN NULL
                      ELSE coalesce(d.group_key, '') END AS g
          FROM {chaos}.deliveries d
          JOIN {schema}.jobs j ON j.key = d.key
          WHERE d.effect = ANY(%(effects)s::text[]) AND d.live_begin) AS d
) AS w
ORDER BY effect, target, g, n DESC;

-- name: seconds_to_end
-- Seconds from commit to end of the jobs that ended: median and worst, for the heavy
-- group (%(heavy)s), the other groups, the jobs with no group, and per priority.
SELECT k.kind, count(*), percentile_cont(0.5) WITHIN GROUP (ORDER BY s.seconds),
       max(s.seconds)
FROM {schema}.jobs j
CROSS JOIN LATERAL (SELECT extract(epoch FROM j.updated_at - j.created_at)::float8) AS s(seconds)
CROSS JOIN LATERAL (VALUES
    (CASE WHEN j.group_key IS NULL THEN 'no group'
          WHEN j.group_key = %(heavy)s::text THEN 'heavy group'
          ELSE 'other groups' END),
    ('priority ' || j.priority)) AS k(kind)
WHERE j.status IN ('done', 'failed', 'reconcile')
GROUP BY k.kind
ORDER BY k.kind;

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
-- reads go on. Held for at most a second, to catch a claim statement in flight. Run
-- against each target's own schema, in one transaction.
LOCK TABLE {schema}.jobs IN SHARE MODE;

-- name: lock_recorded_jobs
-- Row-lock the jobs a worker holds whose provider call ended well under this claim: its
-- next completion statement will wait on them, in flight, until this transaction ends.
-- Run against each target's own schema (FOR UPDATE cannot lock through a UNION ALL).
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
-- Every job with its ledger row, which must be in the job's own target.
SELECT j.id, j.key, j.effect, j.status, j.attempts, j.claim_version, j.last_error,
       r.job_id, r.claim_version, r.result, j.target
FROM {schema}.jobs j
LEFT JOIN {schema}.effect_results r ON r.key = j.key AND r.target = j.target
ORDER BY j.id;

-- name: orphan_ledger_rows
-- Ledger rows without a job in their target (a job row is never deleted during a run:
-- retention is off).
SELECT r.key FROM {schema}.effect_results r
WHERE NOT EXISTS (SELECT 1 FROM {schema}.jobs j WHERE j.key = r.key AND j.target = r.target);

-- name: targets_per_worker
-- For each worker process that called a provider, the targets of the jobs it called for.
SELECT d.worker, count(DISTINCT j.target)::int
FROM {chaos}.deliveries d
JOIN {schema}.jobs j ON j.key = d.key
GROUP BY d.worker;

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
