-- The queue as operators see and operate it (outbox._queue): counts and health per
-- effect, read by the dashboard, `outbox status` and the Prometheus database collector
-- alike; and the operator's transitions (retry, cancel, resolve, bulk retry), run by
-- the dashboard and `outbox retry` alike. {schema} is the quoted schema identifier;
-- {claimable} is the claim's rule (fragment of claim.sql).

-- name: table_size
-- The planner's row estimate and the dead tuples of the jobs table (statistics, no scan),
-- and its pages now (its size on disk, never old: a block sample is sized by it).
SELECT greatest(c.reltuples, 0)::bigint AS estimate,
       coalesce(s.n_dead_tup, 0) AS dead_tuples,
       (pg_relation_size(c.oid) / current_setting('block_size')::bigint) AS pages
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
WHERE n.nspname = %(schema_name)s::text AND c.relname = 'jobs';

-- name: counts_capped
-- Per status, the effects of at most %(cap)s + 1 of its jobs, counted: exact for every
-- status with at most %(cap)s jobs, and a lower bound per effect for a larger one (then
-- estimated from status_sample). Each status is read in its own partial index (the
-- ORDER BY holds the planner to it: a sequential scan with a LIMIT would walk the
-- history to find the pending jobs), jobs_claimable_effect without a visit to the
-- table, and stops at the cap: the reading costs the same behind a backlog of a
-- thousand jobs or of millions.
SELECT 'pending' AS status, p.effect, count(*) AS jobs
FROM (SELECT j.effect FROM {schema}.jobs j WHERE j.status = 'pending'
      ORDER BY j.effect LIMIT %(cap)s::integer + 1) p
GROUP BY p.effect
UNION ALL
SELECT 'running', r.effect, count(*)
FROM (SELECT j.effect FROM {schema}.jobs j WHERE j.status = 'running'
      ORDER BY j.lease_until LIMIT %(cap)s::integer + 1) r
GROUP BY r.effect
UNION ALL
SELECT 'done', d.effect, count(*)
FROM (SELECT j.effect FROM {schema}.jobs j WHERE j.status = 'done'
      ORDER BY j.updated_at LIMIT %(cap)s::integer + 1) d
GROUP BY d.effect
UNION ALL
SELECT 'failed', f.effect, count(*)
FROM (SELECT j.effect FROM {schema}.jobs j WHERE j.status = 'failed'
      ORDER BY j.updated_at LIMIT %(cap)s::integer + 1) f
GROUP BY f.effect
UNION ALL
SELECT 'reconcile', c.effect, count(*)
FROM (SELECT j.effect FROM {schema}.jobs j WHERE j.status = 'reconcile'
      ORDER BY j.updated_at LIMIT %(cap)s::integer + 1) c
GROUP BY c.effect;

-- name: status_sample
-- The jobs of a block sample (%(percent)s of the table's pages, about SAMPLE_PAGES)
-- per status and effect, and per group for the pending ones: the estimate of the
-- statuses past the cap of counts_capped, and of the busiest groups (one sample for
-- both, where busiest_groups would take one of its own, group_sample).
SELECT j.status, j.effect,
       CASE WHEN j.status = 'pending' THEN coalesce(j.group_key, '') END AS group_key,
       count(*) AS sampled
FROM {schema}.jobs j TABLESAMPLE SYSTEM (%(percent)s::float4)
GROUP BY 1, 2, 3;

-- fragment: pending_effects
-- The effects with pending jobs, one probe of jobs_claimable_effect each (a loose index
-- scan: skips from one effect to the next), however many jobs each has; the last row
-- is NULL. Used as a CTE of a WITH RECURSIVE.
pending_effects(effect) AS (
    (SELECT j.effect FROM {schema}.jobs j WHERE j.status = 'pending'
     ORDER BY j.effect LIMIT 1)
    UNION ALL
    SELECT (SELECT j.effect FROM {schema}.jobs j
            WHERE j.status = 'pending' AND j.effect > p.effect
            ORDER BY j.effect LIMIT 1)
    FROM pending_effects p
    WHERE p.effect IS NOT NULL
)

-- name: effect_health
-- Per effect with unfinished jobs: how long the oldest due job has waited, leases past
-- their deadline, how long the oldest reconcile job has waited for a person, and the
-- pending jobs waiting on their parents.
-- "Due" is what a claim would take now: the `claimable` fragment the claim applies, for
-- any effect. A job held back by its ordering key (behind a running
-- job, or behind a pending one retrying later) waits for its key-mate, not for a
-- dispatcher, so it is not due. The oldest due job is found the way a claim finds
-- work, walking the claim index in order and stopping at the first claimable job: no
-- costlier than a claim when a long line waits behind one key. A test compares the
-- result with what a claim takes.
-- Nothing here reads the due backlog: the effects with pending jobs come from a loose
-- index scan (pending_effects), and the rest reads the running jobs (as many as the
-- dispatchers hold), the reconcile jobs and the jobs waiting on parents (whose
-- available_at is after_never: one range of jobs_claimable_effect per effect).
WITH RECURSIVE {pending_effects}, running AS (
    SELECT j.effect, count(*) FILTER (WHERE j.lease_until < now()) AS leases
    FROM {schema}.jobs j
    WHERE j.status = 'running'
    GROUP BY j.effect
), reconciling AS (
    SELECT j.effect, min(j.updated_at) AS oldest
    FROM {schema}.jobs j
    WHERE j.status = 'reconcile'
    GROUP BY j.effect
), waiting AS (
    -- per effect with pending jobs, its range of jobs_claimable_effect at after_never
    SELECT p.effect,
           (SELECT count(*) FROM {schema}.jobs j
            WHERE j.status = 'pending' AND j.effect = p.effect
              AND j.available_at = {after_never} AND j.after_waiting > 0) AS waiting
    FROM pending_effects p
    WHERE p.effect IS NOT NULL
), effects AS (
    SELECT p.effect FROM pending_effects p WHERE p.effect IS NOT NULL
    UNION
    SELECT r.effect FROM running r
    UNION
    SELECT c.effect FROM reconciling c
)
SELECT e.effect,
       extract(epoch FROM now() - (
           SELECT j.available_at
           FROM {schema}.jobs j
           WHERE {claimable} AND j.effect = e.effect
           ORDER BY j.available_at, j.id
           LIMIT 1))::float8 AS oldest_due_age,
       coalesce(r.leases, 0) AS expired_leases,
       extract(epoch FROM now() - c.oldest)::float8 AS oldest_reconcile_age,
       coalesce(w.waiting, 0) AS waiting
FROM effects e
LEFT JOIN running r ON r.effect = e.effect
LEFT JOIN reconciling c ON c.effect = e.effect
LEFT JOIN waiting w ON w.effect = e.effect;

-- name: unserved_due
-- Due pending jobs of effects no live dispatcher serves, per effect: how many (counted
-- up to %(cap)s) and how long the oldest has waited. The effects with pending jobs come
-- from a loose index scan (pending_effects); only an effect nobody serves has its due
-- jobs read, so a scrape costs the same behind any backlog of served effects.
WITH RECURSIVE {pending_effects}
SELECT p.effect,
       (SELECT count(*) FROM (SELECT 1 FROM {schema}.jobs j
                              WHERE j.status = 'pending' AND j.available_at <= now()
                                AND j.effect = p.effect
                              LIMIT %(cap)s::integer) d) AS due,
       extract(epoch FROM now() - (
           SELECT min(j.available_at) FROM {schema}.jobs j
           WHERE j.status = 'pending' AND j.available_at <= now()
             AND j.effect = p.effect))::float8 AS oldest_age
FROM pending_effects p
WHERE p.effect IS NOT NULL
  AND NOT EXISTS (SELECT 1 FROM {schema}.dispatchers d
                  WHERE d.expires_at > now() AND p.effect = ANY(d.effects))
ORDER BY p.effect;

-- name: due_by_effect
-- Per effect with pending jobs (outbox status, the dashboard's targets): how many are
-- due, as a claim decides it (a job held back by its ordering key is not), counted up to
-- %(cap)s, and how many live dispatchers serve the effect. The effects come from a loose
-- index scan (pending_effects) and each count stops at the cap, so the reading costs
-- the same behind any backlog; never the history.
WITH RECURSIVE {pending_effects}
SELECT p.effect,
       (SELECT count(*) FROM (SELECT 1 FROM {schema}.jobs j
                              WHERE {claimable} AND j.effect = p.effect
                              LIMIT %(cap)s::integer) d) AS due,
       (SELECT count(*) FROM {schema}.dispatchers d
        WHERE d.expires_at > now() AND p.effect = ANY(d.effects)) AS dispatchers,
       -- waiting on parents (after=[...], migration 0015): neither due nor scheduled
       (SELECT count(*) FROM {schema}.jobs j
        WHERE j.status = 'pending' AND j.available_at = {after_never}
          AND j.after_waiting > 0 AND j.effect = p.effect) AS waiting
FROM pending_effects p
WHERE p.effect IS NOT NULL
ORDER BY p.effect;

-- name: busiest_groups
-- Per effect with pending jobs, the %(top)s groups with the most pending jobs (the backlog
-- per tenant; '' is the jobs with no group), among at most %(cap)s + 1 pending jobs:
-- exact when no more are pending (capped is false), else a lower bound per group, which
-- group_sample's estimate completes. Never the whole backlog, never the history.
WITH seen AS (
    -- in the fair claim's index order (jobs_fair), never a walk of the table
    SELECT j.effect, coalesce(j.group_key, '') AS g
    FROM {schema}.jobs j
    WHERE j.status = 'pending'
    ORDER BY j.effect, coalesce(j.group_key, '')
    LIMIT %(cap)s::integer + 1
), counted AS (
    SELECT s.effect, s.g, count(*) AS pending FROM seen s GROUP BY s.effect, s.g
)
SELECT t.effect, t.g AS group_key, t.pending,
       (SELECT count(*) FROM seen) > %(cap)s::integer AS capped
FROM (SELECT c.*, row_number() OVER (PARTITION BY c.effect
                                     ORDER BY c.pending DESC, c.g) AS place
      FROM counted c) t
WHERE t.place <= %(top)s::integer
ORDER BY t.effect, t.place;

-- name: group_sample
-- The pending jobs of a block sample (%(percent)s of the table's pages) per effect and
-- group: the estimate of the busiest groups behind a backlog past busiest_groups' cap.
SELECT j.effect, coalesce(j.group_key, '') AS group_key, count(*) AS sampled
FROM {schema}.jobs j TABLESAMPLE SYSTEM (%(percent)s::float4)
WHERE j.status = 'pending'
GROUP BY j.effect, coalesce(j.group_key, '');

-- ---------------------------------------------------------------------------------------
-- The operator's transitions. Each is decided in Python (outbox._lifecycle.operator_action,
-- for the job as operator_read read it) and applied by one statement, operator_apply (a
-- bulk retry: bulk_retry): fenced like the dispatcher's writes (conditional on the status
-- and claim_version the decision was made for, and on the operator's view being those, so
-- a job that moved on meanwhile changes 0 rows and nothing is overwritten), audited in
-- dashboard_audit in the same statement (with the actor, the surface it came through, and
-- the rows it changed), and announced on the schema's channel when it changed something,
-- so a listening dispatcher takes a retried job at once (a cancelled job may free its
-- ordering key too).
-- ---------------------------------------------------------------------------------------

-- fragment: job_filter
-- Optional filters: a NULL parameter disables its condition. The dashboard runs with
-- plan_cache_mode = force_custom_plan, so the planner folds the NULL tests away.
((%(status)s::text IS NULL OR j.status = %(status)s::text)
 AND (%(effect)s::text IS NULL OR j.effect = %(effect)s::text)
 AND (%(key_prefix)s::text IS NULL OR starts_with(j.key, %(key_prefix)s::text))
 AND (%(older_than)s::float8 IS NULL
      OR j.created_at < now() - %(older_than)s::float8 * interval '1 second')
 AND (%(newer_than)s::float8 IS NULL
      OR j.created_at >= now() - %(newer_than)s::float8 * interval '1 second')
 AND (%(error)s::text IS NULL OR strpos(lower(j.last_error), lower(%(error)s::text)) > 0))

-- fragment: audited_action
-- One job's transition in the audit trail, also when it changed nothing (affected 0).
INSERT INTO {schema}.dashboard_audit (actor, action, job_id, detail, affected)
VALUES (%(actor)s::text, %(action)s::text, %(id)s::bigint,
        jsonb_strip_nulls(jsonb_build_object(
            'via', %(via)s::text, 'seen_version', %(seen_version)s::bigint,
            'note', %(note)s::text)),
        (SELECT count(*) FROM changed))

-- fragment: transition_answer
-- The job as the transition left it, with the dispatchers woken; or, when it changed
-- nothing, the job as it is (no row: there is no such job).
SELECT true AS changed, c.status, c.key, c.effect
FROM changed c, pg_notify(%(channel)s::text, '')
UNION ALL
SELECT false, j.status, j.key, j.effect
FROM {schema}.jobs j
WHERE j.id = %(id)s::bigint AND NOT EXISTS (SELECT 1 FROM changed)

-- name: operator_read
-- The job an operator acts on, as the decision (outbox._lifecycle.operator_action) reads
-- it: no lock; the write that applies the decision is fenced on the status and
-- claim_version read here.
SELECT j.status, j.claim_version, j.last_error
FROM {schema}.jobs j
WHERE j.id = %(id)s::bigint;

-- name: operator_apply
-- One operator's decision (retry, cancel, resolve_done, resolve_failed: decided by
-- outbox._lifecycle.operator_action for the job as operator_read read it), applied only
-- if the job still has the status and claim_version it was read with and %(apply)s (the
-- decision applies, and the job is as the operator saw it): else nothing changes and the
-- answer says so. What it writes is the decision's: the status, available_at now plus the
-- delay for a pending job, the attempts, a fresh idempotency window, parents no longer
-- waited for, the error (NULL: kept, unless cleared), a ledger row naming the person
-- (resolve_done), and a running job's claim asked to stop (stop: cancel_version, and
-- every dispatcher told 'cancel <id> <claim_version>'; the heartbeat tells it too). A job
-- settled for good (done or failed) settles the jobs waiting on it (after_released); a
-- running job's children wait for what its perform settles.
WITH changed AS (
    UPDATE {schema}.jobs j
    SET status = %(status)s::text,
        attempts = coalesce(%(attempts)s::integer, j.attempts),
        available_at = CASE WHEN %(status)s::text = 'pending'
                            THEN now() + %(delay)s::float8 * interval '1 second'
                            ELSE j.available_at END,
        first_attempted_at = CASE WHEN %(fresh_window)s::boolean THEN NULL
                                  ELSE j.first_attempted_at END,
        after_waiting = CASE WHEN %(waive_parents)s::boolean THEN 0 ELSE j.after_waiting END,
        cancel_version = CASE WHEN %(stop)s::boolean THEN j.claim_version
                              ELSE j.cancel_version END,
        last_error = CASE WHEN %(clear_error)s::boolean THEN NULL
                          ELSE coalesce(%(error)s::text, j.last_error) END,
        updated_at = now()
    WHERE j.id = %(id)s::bigint AND j.status = %(read_status)s::text
      AND j.claim_version = %(read_version)s::bigint AND %(apply)s::boolean
    RETURNING j.id, j.status, j.key, j.effect, j.claim_version, j.fingerprint, j.last_error,
              jsonb_build_object('resolved_by', %(actor)s::text,
                                 'note', coalesce(%(note)s::text, '')) AS result,
              CASE WHEN %(stop)s::boolean
                   THEN pg_notify(%(channel)s::text,
                                  'cancel ' || j.id || ' ' || j.claim_version)::text END
              AS told
), finished AS (
    SELECT c.* FROM changed c WHERE %(ledger)s::boolean
), {recorded}, parents AS (
    SELECT c.key, c.status AS outcome, c.last_error AS error FROM changed c
    WHERE c.status IN ('done', 'failed')
), {after_released}, audited AS (
    {audited_action}
)
{transition_answer};

-- name: bulk_retry
-- Failed jobs matching the filter back to pending, newest first, at most %(cap)s: the
-- decision of a retry of a failed job (outbox._lifecycle.operator_action), the same for
-- each, applied to each (the status it was picked with is checked again on the update,
-- under the row lock the pick took). Rows another session holds are skipped rather than
-- waited for. Audited as one bulk_retry row with the filter; the number retried
-- comes back.
WITH picked AS (
    SELECT j.id FROM {schema}.jobs j
    WHERE {job_filter} AND j.status = 'failed'
    ORDER BY j.id DESC
    LIMIT %(cap)s
    FOR UPDATE SKIP LOCKED
), changed AS (
    UPDATE {schema}.jobs j
    SET status = %(decided_status)s::text,
        attempts = coalesce(%(decided_attempts)s::integer, j.attempts),
        available_at = now() + %(decided_delay)s::float8 * interval '1 second',
        first_attempted_at = CASE WHEN %(decided_fresh_window)s::boolean THEN NULL
                                  ELSE j.first_attempted_at END,
        after_waiting = CASE WHEN %(decided_waive_parents)s::boolean THEN 0
                             ELSE j.after_waiting END,
        last_error = coalesce(%(decided_error)s::text, j.last_error),
        updated_at = now()
    FROM picked p
    WHERE j.id = p.id AND j.status = 'failed'
    RETURNING j.id
), audited AS (
    INSERT INTO {schema}.dashboard_audit (actor, action, job_id, detail, affected)
    VALUES (%(actor)s::text, 'bulk_retry', NULL,
            jsonb_strip_nulls(jsonb_build_object(
                'filter', %(described)s::jsonb, 'cap', %(cap)s::integer,
                'via', %(via)s::text)),
            (SELECT count(*) FROM changed))
)
SELECT count(*) AS retried FROM changed c, pg_notify(%(channel)s::text, '');
