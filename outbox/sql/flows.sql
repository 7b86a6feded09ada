-- Flows and reconciliation: the statements of completion hooks and of the reconciler.
-- Same rules as queries.sql: {schema} is the quoted schema identifier, values are bound
-- by name, and every write about a claimed job is fenced on its claim_version.

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
WHERE j.id = CAST(%(id)s AS bigint) AND j.status = 'running'
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
    WHERE j.id = CAST(%(id)s AS bigint) AND j.status = 'running'
      AND j.claim_version = CAST(%(version)s AS bigint)
    RETURNING j.id, j.key, j.effect, j.claim_version, j.fingerprint
), recorded AS (
    INSERT INTO {schema}.effect_results (key, effect, job_id, claim_version, result, fingerprint)
    SELECT f.key, f.effect, f.id, f.claim_version, CAST(%(result)s AS jsonb), f.fingerprint
    FROM finished f
    ON CONFLICT (key) DO NOTHING
)
SELECT f.id FROM finished f;
