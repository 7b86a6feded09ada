-- The dashboard's statements, as named blocks. {schema} is the quoted schema identifier;
-- {job_filter} is the `job_filter` block below, shared by the list, its count and the
-- bulk retry so that what an operator sees is exactly what a bulk action touches.
-- Every write is fenced like the dispatcher's: conditional on the status (and, for one
-- job, the claim_version) the operator saw, so a job that moved on meanwhile changes 0
-- rows and nothing is overwritten. Every write records itself in dashboard_audit in the
-- same statement.

-- name: job_filter
-- Optional filters: a NULL parameter disables its condition. Requests run with
-- plan_cache_mode = force_custom_plan, so the planner folds the NULL tests away.
(%(status)s::text IS NULL OR j.status = %(status)s::text)
AND (%(effect)s::text IS NULL OR j.effect = %(effect)s::text)
AND (%(key_prefix)s::text IS NULL OR starts_with(j.key, %(key_prefix)s::text))
AND (%(older_than)s::float8 IS NULL
     OR j.created_at < now() - %(older_than)s::float8 * interval '1 second')
AND (%(newer_than)s::float8 IS NULL
     OR j.created_at >= now() - %(newer_than)s::float8 * interval '1 second')
AND (%(error)s::text IS NULL OR strpos(lower(j.last_error), lower(%(error)s::text)) > 0)

-- name: writable
-- Whether this session may act: not a read-only transaction or a standby, and allowed
-- to update the jobs and write the audit trail.
SELECT NOT (current_setting('transaction_read_only')::boolean OR pg_is_in_recovery())
       AND has_table_privilege(%(jobs_table)s::text, 'UPDATE')
       AND has_table_privilege(%(audit_table)s::text, 'INSERT');

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
-- Effect names for the filter menu, read off the claim index's smaller cousins first.
SELECT DISTINCT j.effect FROM {schema}.jobs j
WHERE j.status IN ('pending', 'running', 'failed', 'reconcile')
UNION
SELECT r.effect FROM (SELECT DISTINCT effect FROM {schema}.effect_results) r
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

-- name: job_count
-- Matching jobs, counted up to a cap: beyond it the page says "more than".
SELECT count(*) FROM (
    SELECT 1 FROM {schema}.jobs j WHERE {job_filter} LIMIT %(cap)s
) AS capped;

-- name: job_detail
SELECT j.id, j.effect, j.key, j.status, j.attempts, j.max_attempts, j.claim_version,
       j.available_at, j.lease_until, j.claimed_by, j.ordering_key, j.last_error,
       j.first_attempted_at, j.created_at, j.updated_at, j.payload, j.trace_context
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

-- name: retry
-- failed or reconcile -> pending with a fresh attempt budget and idempotency window,
-- as `outbox retry` does; wakes the dispatchers when it lands.
WITH changed AS (
    UPDATE {schema}.jobs j
    SET status = 'pending', attempts = 0, available_at = now(), first_attempted_at = NULL,
        updated_at = now()
    WHERE j.id = %(id)s::bigint AND j.status = %(seen_status)s::text
      AND j.status IN ('failed', 'reconcile') AND j.claim_version = %(seen_version)s::bigint
    RETURNING j.id
), audited AS (
    INSERT INTO {schema}.dashboard_audit (actor, action, job_id, detail, affected)
    VALUES (%(actor)s::text, 'retry', %(id)s::bigint, %(detail)s::jsonb,
            (SELECT count(*) FROM changed))
)
SELECT count(*) FROM changed c, pg_notify(%(channel)s::text, '');

-- name: resolve_done
-- A person checked the provider and the effect did happen: reconcile -> done with a
-- ledger row naming who decided, so the key is never performed again.
WITH changed AS (
    UPDATE {schema}.jobs j
    SET status = 'done', last_error = NULL, updated_at = now()
    WHERE j.id = %(id)s::bigint AND j.status = 'reconcile'
      AND j.claim_version = %(seen_version)s::bigint
    RETURNING j.id, j.key, j.effect, j.claim_version, j.fingerprint
), recorded AS (
    INSERT INTO {schema}.effect_results (key, effect, job_id, claim_version, result, fingerprint)
    SELECT c.key, c.effect, c.id, c.claim_version, %(result)s::jsonb, c.fingerprint
    FROM changed c
    ON CONFLICT (key) DO NOTHING
), audited AS (
    INSERT INTO {schema}.dashboard_audit (actor, action, job_id, detail, affected)
    VALUES (%(actor)s::text, 'resolve_done', %(id)s::bigint, %(detail)s::jsonb,
            (SELECT count(*) FROM changed))
)
SELECT count(*) FROM changed;

-- name: resolve_failed
-- A person checked the provider and the effect did not happen: reconcile -> failed.
WITH changed AS (
    UPDATE {schema}.jobs j
    SET status = 'failed', updated_at = now(),
        last_error = 'resolved as not performed by ' || %(actor)s::text
                     || coalesce(': ' || j.last_error, '')
    WHERE j.id = %(id)s::bigint AND j.status = 'reconcile'
      AND j.claim_version = %(seen_version)s::bigint
    RETURNING j.id
), audited AS (
    INSERT INTO {schema}.dashboard_audit (actor, action, job_id, detail, affected)
    VALUES (%(actor)s::text, 'resolve_failed', %(id)s::bigint, %(detail)s::jsonb,
            (SELECT count(*) FROM changed))
)
SELECT count(*) FROM changed;

-- name: cancel
-- pending -> failed, never performed. A claimed (running) job cannot be cancelled: its
-- effect may already be at the provider.
WITH changed AS (
    UPDATE {schema}.jobs j
    SET status = 'failed', updated_at = now(),
        last_error = 'cancelled from the dashboard by ' || %(actor)s::text
    WHERE j.id = %(id)s::bigint AND j.status = 'pending'
      AND j.claim_version = %(seen_version)s::bigint
    RETURNING j.id
), audited AS (
    INSERT INTO {schema}.dashboard_audit (actor, action, job_id, detail, affected)
    VALUES (%(actor)s::text, 'cancel', %(id)s::bigint, %(detail)s::jsonb,
            (SELECT count(*) FROM changed))
)
SELECT count(*) FROM changed;

-- name: bulk_retry
-- Failed jobs matching the filter back to pending, newest first, at most %(cap)s. Rows
-- another session holds are skipped rather than waited for.
WITH picked AS (
    SELECT j.id FROM {schema}.jobs j
    WHERE {job_filter} AND j.status = 'failed'
    ORDER BY j.id DESC
    LIMIT %(cap)s
    FOR UPDATE SKIP LOCKED
), changed AS (
    UPDATE {schema}.jobs j
    SET status = 'pending', attempts = 0, available_at = now(), first_attempted_at = NULL,
        updated_at = now()
    FROM picked p
    WHERE j.id = p.id AND j.status = 'failed'
    RETURNING j.id
), audited AS (
    INSERT INTO {schema}.dashboard_audit (actor, action, job_id, detail, affected)
    VALUES (%(actor)s::text, 'bulk_retry', NULL, %(detail)s::jsonb,
            (SELECT count(*) FROM changed))
)
SELECT count(*) FROM changed c, pg_notify(%(channel)s::text, '');
