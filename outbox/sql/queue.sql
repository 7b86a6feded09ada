-- The queue as operators see it: counts and health per effect, read by the dashboard
-- and the Prometheus database collector alike. {schema} is the quoted schema
-- identifier; {claimable} is the `claimable` block below.

-- name: claimable
-- A job the claim would take now (the claim's own rules, for any effect): pending, due,
-- and not held back by its ordering key (no earlier job of the key unfinished, none
-- running). Kept in step with the `claim` and `has_due_work` blocks of queries.sql; a
-- test compares what this counts as due with what a claim takes.
j.status = 'pending'
AND j.available_at <= now()
AND (j.ordering_key IS NULL OR NOT EXISTS (
      SELECT 1 FROM {schema}.jobs o
      WHERE o.ordering_key = j.ordering_key
        AND o.id <> j.id
        AND (o.status = 'running' OR (o.status = 'pending' AND o.id < j.id))))

-- name: table_size
-- The planner's row estimate and the dead tuples of the jobs table (statistics, no scan).
SELECT greatest(c.reltuples, 0)::bigint AS estimate,
       coalesce(s.n_dead_tup, 0) AS dead_tuples
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
WHERE n.nspname = %(schema_name)s::text AND c.relname = 'jobs';

-- name: counts_exact
SELECT j.status, j.effect, count(*) AS jobs
FROM {schema}.jobs j
GROUP BY j.status, j.effect;

-- name: counts_unfinished
-- Exact counts of the states an operator acts on; the partial indexes serve them.
SELECT j.status, j.effect, count(*) AS jobs
FROM {schema}.jobs j
WHERE j.status IN ('pending', 'running', 'failed', 'reconcile')
GROUP BY j.status, j.effect;

-- name: done_sample
-- On a large table, done jobs (history) are estimated from a block sample instead of
-- being counted.
SELECT j.effect, count(*) AS sampled
FROM {schema}.jobs j TABLESAMPLE SYSTEM (%(percent)s::float4)
WHERE j.status = 'done'
GROUP BY j.effect;

-- name: effect_health
-- Per effect: how long the oldest due job has waited, leases past their deadline, how
-- long the oldest reconcile job has waited for a person, and how many jobs are due.
-- "Due" is what a claim would take now: a job held back by its ordering key (behind a
-- running job, or a pending one retrying later) is waiting for its key-mate, not for a
-- dispatcher, so it is not due.
SELECT j.effect,
       extract(epoch FROM now() - min(j.available_at) FILTER (WHERE d.due))::float8
           AS oldest_due_age,
       count(*) FILTER (WHERE j.status = 'running' AND j.lease_until < now()) AS expired_leases,
       extract(epoch FROM now() - min(j.updated_at)
               FILTER (WHERE j.status = 'reconcile'))::float8 AS oldest_reconcile_age,
       count(*) FILTER (WHERE d.due) AS due
FROM {schema}.jobs j
CROSS JOIN LATERAL (SELECT CASE WHEN j.status = 'pending' AND j.available_at <= now()
                                THEN {claimable} ELSE false END AS due) d
WHERE j.status IN ('pending', 'running', 'reconcile')
GROUP BY j.effect;
