-- The dashboard's reading statements, as named blocks. {schema} is the quoted schema
-- identifier; {job_filter} is the fragment of the core's sql/queue.sql that the queue
-- model's bulk retry applies too, so that what an operator sees is exactly what a bulk
-- action touches. The actions themselves (retry, cancel, resolve, bulk retry: fenced,
-- audited, waking the dispatchers) are the queue model's (outbox._queue), as the
-- command line's are.

-- name: writable
-- Whether this session may act: not a read-only transaction or a standby, and allowed
-- to update the jobs and write the audit trail.
SELECT NOT (current_setting('transaction_read_only')::boolean OR pg_is_in_recovery())
       AND has_table_privilege(%(jobs_table)s::text, 'UPDATE')
       AND has_table_privilege(%(audit_table)s::text, 'INSERT') AS writable;

-- name: settled_per_minute
-- Jobs that reached a final state, per minute over the window: throughput and failures.
-- A done job's updated_at is its completion time (retention deletes it much later).
SELECT date_bin(interval '1 minute', j.updated_at, %(since)s::timestamptz) AS minute,
       count(*) FILTER (WHERE j.status = 'done') AS done,
       count(*) FILTER (WHERE j.status IN ('failed', 'reconcile')) AS failed
FROM {schema}.jobs j
WHERE j.status IN ('done', 'failed', 'reconcile') AND j.updated_at >= %(since)s::timestamptz
GROUP BY 1
ORDER BY 1;

-- name: dispatchers
-- Workers holding claims now (claimed_by is cleared when a job settles).
SELECT j.claimed_by, count(*) AS running, min(j.lease_until) AS next_lease_end,
       max(j.updated_at) AS last_claim
FROM {schema}.jobs j
WHERE j.status = 'running'
GROUP BY j.claimed_by
ORDER BY j.claimed_by
LIMIT 50;

-- name: effects_seen
-- Effect names for the filter menu, none of whose parts reads the backlog or the
-- history: the effects with pending jobs (a loose index scan, one probe each), those of
-- running jobs (as many as the dispatchers hold) and of the latest failed and reconcile
-- jobs, those the dispatchers serve, those with a limit row, and the common values the
-- planner's statistics hold for the jobs' and the ledger's effect column (done jobs and
-- the ledger are history: an effect seen there only, and rarely, may be missing until
-- its next ANALYZE; the menu keeps an effect typed in the address).
WITH RECURSIVE {pending_effects}, named AS (
    SELECT p.effect FROM pending_effects p WHERE p.effect IS NOT NULL
    UNION
    SELECT j.effect FROM {schema}.jobs j WHERE j.status = 'running'
    UNION
    SELECT f.effect FROM (SELECT j.effect FROM {schema}.jobs j WHERE j.status = 'failed'
                          ORDER BY j.updated_at DESC LIMIT 1000) f
    UNION
    SELECT c.effect FROM (SELECT j.effect FROM {schema}.jobs j WHERE j.status = 'reconcile'
                          ORDER BY j.updated_at DESC LIMIT 1000) c
    UNION
    SELECT unnest(d.effects) FROM {schema}.dispatchers d
    UNION
    SELECT l.effect FROM {schema}.effect_limits l
    UNION
    SELECT unnest(s.most_common_vals::text::text[]) FROM pg_stats s
    WHERE s.schemaname = %(schema_name)s::text AND s.tablename IN ('jobs', 'effect_results')
      AND s.attname = 'effect'
    UNION
    SELECT unnest(s.histogram_bounds::text::text[]) FROM pg_stats s
    WHERE s.schemaname = %(schema_name)s::text AND s.tablename IN ('jobs', 'effect_results')
      AND s.attname = 'effect'
)
SELECT n.effect FROM named n
ORDER BY 1
LIMIT 200;

-- name: job_page
-- Newest first, keyset-paginated on id: a page costs the same on page 1 and page 1000.
SELECT j.id, j.effect, j.key, j.status, j.attempts, j.max_attempts, j.claim_version,
       j.available_at, j.created_at, j.updated_at, left(j.last_error, 300) AS last_error
FROM {schema}.jobs j
WHERE {job_filter}
  AND (%(before)s::bigint IS NULL OR j.id < %(before)s::bigint)
ORDER BY j.id DESC
LIMIT %(limit)s;

-- name: job_page_finished
-- One status of finished jobs (done, failed, reconcile), the most recently finished
-- first, keyset-paginated on (updated_at, id): read in that status's part of
-- jobs_finished, so a page costs a page however many newer jobs (a backlog of pending
-- ones) stand between the finished ones in id order, where job_page would walk them all.
SELECT j.id, j.effect, j.key, j.status, j.attempts, j.max_attempts, j.claim_version,
       j.available_at, j.created_at, j.updated_at, left(j.last_error, 300) AS last_error
FROM {schema}.jobs j
WHERE {job_filter}
  AND j.status = %(status)s::text AND j.status IN ('done', 'failed', 'reconcile')
  AND (%(before_at)s::timestamptz IS NULL
       OR j.updated_at < %(before_at)s::timestamptz
       OR (j.updated_at = %(before_at)s::timestamptz AND j.id < %(before)s::bigint))
ORDER BY j.updated_at DESC, j.id DESC
LIMIT %(limit)s;

-- name: job_count
-- Matching jobs, counted up to a cap: beyond it the page says "more than".
SELECT count(*) AS jobs FROM (
    SELECT 1 FROM {schema}.jobs j WHERE {job_filter} LIMIT %(cap)s
) AS capped;

-- name: job_detail
SELECT j.id, j.effect, j.key, j.status, j.attempts, j.max_attempts, j.claim_version,
       j.available_at, j.lease_until, j.claimed_by, j.ordering_key, j.last_error,
       j.first_attempted_at, j.created_at, j.updated_at, j.payload, j.trace_context,
       j.after_waiting, j.after_failed
FROM {schema}.jobs j
WHERE j.id = %(id)s::bigint;

-- name: job_ledger
SELECT r.job_id, r.claim_version, r.result, r.recorded_at
FROM {schema}.effect_results r
WHERE r.key = %(key)s::text;

-- name: job_audit
SELECT a.at, a.actor, a.action, a.detail, a.affected
FROM {schema}.dashboard_audit a
WHERE a.job_id = %(id)s::bigint
ORDER BY a.at DESC, a.id DESC
LIMIT 50;

-- name: recent_audit
SELECT a.at, a.actor, a.action, a.job_id, a.detail, a.affected
FROM {schema}.dashboard_audit a
ORDER BY a.id DESC
LIMIT %(limit)s;

-- Flows: where a job stands in its chain, and what the reconciler decided about it.

-- name: job_flow
-- The job's parent (the job whose completion hook enqueued it), whether it carries a
-- provider answer kept after a hook failed, and the reconciler's schedule.
SELECT j.parent_key, p.id AS parent_id, p.status AS parent_status,
       j.performed_result IS NOT NULL AS kept_result, j.reconcile_at, j.reconcile_checks
FROM {schema}.jobs j
LEFT JOIN {schema}.jobs p ON p.key = j.parent_key
WHERE j.id = %(id)s::bigint;

-- name: job_followups
-- The jobs this job's completion hooks enqueued, in enqueue order.
SELECT f.id, f.effect, f.key, f.status, f.updated_at
FROM {schema}.jobs f
WHERE f.parent_key = %(key)s::text
ORDER BY f.id
LIMIT 100;

-- name: job_after
-- A job's parents and children (fan-in, after=[...]; migration 0015): each related job's key, its status
-- (NULL: only the ledger remembers it, done) and the edge's outcome; relation 'parent'
-- (the job waits on it) or 'child' (it waits on the job).
SELECT 'parent' AS relation, e.parent_key AS key, pj.id, pj.status, pj.effect, e.outcome
FROM {schema}.after_edges e
LEFT JOIN {schema}.jobs pj ON pj.key = e.parent_key
WHERE e.child_id = %(id)s::bigint
UNION ALL
SELECT 'child', cj.key, cj.id, cj.status, cj.effect, e.outcome
FROM {schema}.after_edges e
JOIN {schema}.jobs cj ON cj.id = e.child_id
WHERE e.parent_key = %(key)s::text
ORDER BY 1 DESC, 2
LIMIT %(limit)s::integer;

-- name: job_reconciliation
-- The reconciler's decisions about the job, newest first.
SELECT a.at, a.detail->>'decision' AS decision, a.detail->>'source' AS source, a.affected
FROM {schema}.dashboard_audit a
WHERE a.job_id = %(id)s::bigint AND a.actor = 'reconciler'
ORDER BY a.at DESC, a.id DESC
LIMIT 50;
