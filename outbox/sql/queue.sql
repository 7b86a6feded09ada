-- The queue as operators see it: counts and health per effect, read by the dashboard
-- and the Prometheus database collector alike. {schema} is the quoted schema
-- identifier.

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
-- Per effect with unfinished jobs: how long the oldest due job has waited, leases past
-- their deadline, and how long the oldest reconcile job has waited for a person.
-- "Due" is what a claim would take now: the predicate below is the `claim` block's of
-- queries.sql, for any effect. A job held back by its ordering key (behind a running
-- job, or behind a pending one retrying later) waits for its key-mate, not for a
-- dispatcher, so it is not due. The oldest due job is found the way a claim finds
-- work, walking the claim index in order and stopping at the first claimable job: as
-- cheap as counting was when nothing is held back, and no costlier than a claim when a
-- long line waits behind one key. A test compares the result with what a claim takes.
WITH unfinished AS (
    SELECT j.effect,
           count(*) FILTER (WHERE j.status = 'running' AND j.lease_until < now()) AS leases,
           min(j.updated_at) FILTER (WHERE j.status = 'reconcile') AS reconcile
    FROM {schema}.jobs j
    WHERE j.status IN ('pending', 'running', 'reconcile')
    GROUP BY j.effect
)
SELECT u.effect,
       extract(epoch FROM now() - (
           SELECT j.available_at
           FROM {schema}.jobs j
           WHERE j.status = 'pending' AND j.available_at <= now() AND j.effect = u.effect
             AND (j.ordering_key IS NULL OR NOT EXISTS (
                   SELECT 1 FROM {schema}.jobs o
                   WHERE o.ordering_key = j.ordering_key
                     AND o.id <> j.id
                     AND (o.status = 'running' OR (o.status = 'pending' AND o.id < j.id))))
           ORDER BY j.available_at, j.id
           LIMIT 1))::float8 AS oldest_due_age,
       u.leases AS expired_leases,
       extract(epoch FROM now() - u.reconcile)::float8 AS oldest_reconcile_age
FROM unfinished u;
