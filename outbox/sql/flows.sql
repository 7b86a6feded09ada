-- Flows and reconciliation: the statements of completion hooks and of the reconciler.
-- Same rules as the core's other files (outbox/_sql.py CORE_FILES): {schema} is the quoted schema identifier, values are bound
-- by name, and every write about a claimed job is fenced on its claim_version (its status
-- test written as record.sql's header says, so that the job is found by its primary key).

-- name: adopt_followups
-- Follow-up jobs a completion hook created remember the job that enqueued them.
UPDATE {schema}.jobs SET parent_key = CAST(%(parent)s AS text)
WHERE id = ANY(CAST(%(ids)s AS bigint[]));

-- name: keep_result
-- A completion hook raised after the provider acted: back to pending (fenced) with the
-- provider's answer kept, so the next claim reuses it instead of performing again.
UPDATE {schema}.jobs j
SET status = 'pending',
    performed_result = CAST(%(result)s AS jsonb),
    available_at = now() + CAST(%(delay)s AS float8) * interval '1 second',
    last_error = CAST(%(error)s AS text),
    lease_until = NULL,
    claimed_by = NULL,
    updated_at = now()
WHERE j.id = CAST(%(id)s AS bigint) AND j.status IS NOT DISTINCT FROM 'running'
  AND j.claim_version = CAST(%(version)s AS bigint)
RETURNING j.id;

-- name: fail_performed
-- A completion hook kept raising until max_attempts: failed with the hook's error, and
-- the provider's answer in the ledger, in one fenced statement (a ledger row is written
-- only together with a fenced status change). The kept answer stays on the job, so an
-- operator's retry runs the hook again without performing again.
WITH finished AS (
    UPDATE {schema}.jobs j
    SET status = 'failed',
        performed_result = CAST(%(result)s AS jsonb),
        last_error = CAST(%(error)s AS text),
        lease_until = NULL,
        claimed_by = NULL,
        updated_at = now()
    WHERE j.id = CAST(%(id)s AS bigint) AND j.status IS NOT DISTINCT FROM 'running'
      AND j.claim_version = CAST(%(version)s AS bigint)
    RETURNING j.id, j.key, j.effect, j.claim_version, j.fingerprint,
              CAST(%(result)s AS jsonb) AS result, j.last_error
), {recorded}, parents AS (
    -- jobs waiting on it (after=[...]) see it failed (fragment after_released)
    SELECT f.key, 'failed'::text AS outcome, f.last_error AS error FROM finished f
), {after_released}
SELECT f.id FROM finished f;

-- ---------------------------------------------------------------------------------------
-- The reconciler: asks the provider about jobs in reconcile, outside any transaction,
-- and writes each answer fenced on the claim_version it took the job at.
-- ---------------------------------------------------------------------------------------

-- name: reconcile_take
-- Take up to %(limit)s jobs in reconcile that are due to be asked, for effects this
-- dispatcher can reconcile: jobs new to reconcile (their claim_version is not the one the
-- reconciler last wrote) and jobs whose next ask has come, unless it gave up on them.
-- Taking bumps claim_version (the fence of the answer) and pushes reconcile_at ahead by
-- %(hold)s seconds, so another dispatcher does not ask about the same job meanwhile;
-- SKIP LOCKED keeps two takes apart. A job new to reconcile starts with no checks.
WITH due AS (
    SELECT id FROM {schema}.jobs
    WHERE status = 'reconcile'
      AND effect = ANY(CAST(%(effects)s AS text[]))
      AND (reconcile_version IS DISTINCT FROM claim_version OR reconcile_at <= now())
    ORDER BY reconcile_at NULLS FIRST, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE {schema}.jobs j
SET claim_version = j.claim_version + 1,
    reconcile_version = j.claim_version + 1,
    -- An operator's cancel follows the job into reconcile (see reconcile_not_performed).
    cancel_version = CASE WHEN j.cancel_version = j.claim_version
                          THEN j.claim_version + 1 ELSE j.cancel_version END,
    reconcile_checks = CASE WHEN j.reconcile_version IS DISTINCT FROM j.claim_version
                            THEN 0 ELSE j.reconcile_checks END,
    reconcile_at = now() + CAST(%(hold)s AS float8) * interval '1 second'
FROM due
WHERE j.id = due.id AND j.status = 'reconcile'
RETURNING j.id, j.effect, j.key, j.payload, j.attempts, j.claim_version, j.ordering_key,
          j.max_attempts, j.first_attempted_at, j.reconcile_checks, j.created_at,
          j.group_key, j.priority,
          j.cancel_version IS NOT DISTINCT FROM j.claim_version AS cancelled;

-- name: reconcile_done
-- The provider did act: reconcile -> done with the ledger row, fenced.
WITH finished AS (
    UPDATE {schema}.jobs j
    SET status = 'done', reconcile_at = NULL, last_error = NULL, updated_at = now()
    WHERE j.id = CAST(%(id)s AS bigint) AND j.status = 'reconcile'
      AND j.claim_version = CAST(%(version)s AS bigint)
    RETURNING j.id, j.key, j.effect, j.claim_version, j.fingerprint,
              CAST(%(result)s AS jsonb) AS result
), {recorded}, parents AS (
    SELECT f.key, 'done'::text AS outcome, NULL::text AS error FROM finished f
), {after_released}
SELECT f.id FROM finished f;

-- name: reconcile_fail
-- The provider acted and refused (a reconcile that raised Permanent): failed, fenced;
-- the jobs waiting on it see it failed (fragment after_released).
WITH failed AS (
    UPDATE {schema}.jobs j
    SET status = 'failed', reconcile_at = NULL, last_error = CAST(%(error)s AS text),
        updated_at = now()
    WHERE j.id = CAST(%(id)s AS bigint) AND j.status = 'reconcile'
      AND j.claim_version = CAST(%(version)s AS bigint)
    RETURNING j.id, j.key, j.last_error
), parents AS (
    SELECT f.key, 'failed'::text AS outcome, f.last_error AS error FROM failed f
), {after_released}
SELECT f.id FROM failed f;

-- name: reconcile_keep
-- The provider did act but on_done raised: back to pending with the answer kept, so the
-- next claim runs the hook again without performing (as after any hook failure).
UPDATE {schema}.jobs j
SET status = 'pending', performed_result = CAST(%(result)s AS jsonb), attempts = 0,
    available_at = now(), reconcile_at = NULL, reconcile_checks = 0,
    last_error = CAST(%(error)s AS text), updated_at = now()
WHERE j.id = CAST(%(id)s AS bigint) AND j.status = 'reconcile'
  AND j.claim_version = CAST(%(version)s AS bigint)
RETURNING j.id;

-- name: reconcile_not_performed
-- The provider has no trace: the reconciler's decision (outbox._lifecycle.settle_answer):
-- back to pending under the same key, with a fresh attempt budget and a fresh idempotency
-- window, as an operator's retry would; or, for a job an operator cancelled while it ran
-- (reconcile_take says which), failed: it never acted. Fenced; a job failed for good
-- settles the jobs waiting on it (fragment after_released).
WITH changed AS (
    UPDATE {schema}.jobs j
    SET status = CAST(%(status)s AS text),
        attempts = coalesce(CAST(%(attempts)s AS integer), j.attempts),
        first_attempted_at = CASE WHEN CAST(%(fresh_window)s AS boolean) THEN NULL
                                  ELSE j.first_attempted_at END,
        available_at = now() + CAST(%(delay)s AS float8) * interval '1 second',
        reconcile_at = NULL, reconcile_checks = 0,
        last_error = CAST(%(error)s AS text),
        updated_at = now()
    WHERE j.id = CAST(%(id)s AS bigint) AND j.status = 'reconcile'
      AND j.claim_version = CAST(%(version)s AS bigint)
    RETURNING j.id, j.key, j.status, j.last_error
), parents AS (
    SELECT c.key, c.status AS outcome, c.last_error AS error FROM changed c
    WHERE c.status = 'failed'
), {after_released}
SELECT c.id FROM changed c;

-- name: reconcile_later
-- Still unknown (or the provider unreachable): ask again after %(delay)s seconds (NULL:
-- never again, a person decides: NULL + NULL is NULL). %(answered)s counts the pass
-- toward giving up.
UPDATE {schema}.jobs j
SET reconcile_at = now() + CAST(%(delay)s AS float8) * interval '1 second',
    reconcile_checks = j.reconcile_checks + CASE WHEN CAST(%(answered)s AS boolean) THEN 1 ELSE 0 END,
    last_error = coalesce(CAST(%(error)s AS text), j.last_error),
    updated_at = now()
WHERE j.id = CAST(%(id)s AS bigint) AND j.status = 'reconcile'
  AND j.claim_version = CAST(%(version)s AS bigint)
RETURNING j.id;

-- name: reconcile_audit
-- Every decision of the reconciler, in the transaction of the write it describes (also
-- when the fence refused it: affected = 0), beside the operators' actions.
INSERT INTO {schema}.dashboard_audit (actor, action, job_id, detail, affected)
VALUES ('reconciler', 'reconcile', CAST(%(id)s AS bigint), CAST(%(detail)s AS jsonb),
        CAST(%(affected)s AS integer));
