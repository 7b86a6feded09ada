-- The fenced writes about a claim: the recorder's heartbeat, completion and settle
-- (outbox/_dispatch/recorder.py, hooked.py), the rescuer's (rescuer.py): each applies
-- the lifecycle's decision (outbox/_lifecycle.py)
--
-- Named blocks, loaded by outbox/_sql.py (the core's files, CORE_FILES, bound as one set
-- of names: queries(schema).<name>). {schema} is replaced by the quoted schema identifier
-- when a block is loaded (psycopg.sql.Identifier); values are always bound parameters, by
-- name. A write about a claimed job is conditional on status = 'running' AND
-- claim_version = the claim's version, so a stale worker's write changes 0 rows. A
-- `-- fragment: X` block is no statement: its text is bound into every block of the core
-- files and the dashboard's that names {X}, so a rule used by several is written once.
--
-- The fenced writes below find their claims by the primary key, one probe a claim, so
-- each costs its batch whatever the number of running jobs. Their fence on the status
-- is written `j.status IS NOT DISTINCT FROM 'running'` (the same test: status is NOT
-- NULL) so that the planner cannot read the claims through jobs_leases, the partial
-- index of the running jobs: with statistics taken while few jobs ran (a drain's start,
-- a queue filled in bulk) it takes that index for nearly empty and hashes the batch
-- against every running job, 4,000 rows read for a claim of 17 when the recorder lags
-- (tests/plans/test_fenced_writes.py).

-- name: heartbeat
-- Extend the leases of the claims this worker still holds; ids missing from the result
-- are claims it has lost; cancel says an operator asked this claim to stop (outbox
-- cancel: the fallback of its notification). Batches arrive as one JSON array of {id, version, ...}
-- objects: one parameter, parsed by the server, whatever the batch size.
UPDATE {schema}.jobs j
SET lease_until = now() + %(lease)s::float8 * interval '1 second'
FROM jsonb_to_recordset(%(claims)s::jsonb) AS h(id bigint, version bigint)
WHERE j.id = h.id AND j.status IS NOT DISTINCT FROM 'running' AND j.claim_version = h.version
RETURNING j.id, j.cancel_version IS NOT DISTINCT FROM j.claim_version AS cancel;

-- fragment: recorded
-- The ledger row of each job the fenced status change in the CTE finished took (its id,
-- key, effect, claim_version, fingerprint and result), written in the same statement: a
-- ledger row is never written otherwise. A key already in the ledger keeps its row.
recorded AS (
    INSERT INTO {schema}.effect_results (key, effect, job_id, claim_version, result, fingerprint)
    SELECT f.key, f.effect, f.id, f.claim_version, f.result, f.fingerprint FROM finished f
    ON CONFLICT (key) DO NOTHING
)

-- name: complete
-- running -> done and the ledger row, in one statement and so in one transaction.
WITH finished AS (
    UPDATE {schema}.jobs j
    SET status = 'done', lease_until = NULL, claimed_by = NULL, last_error = NULL,
        updated_at = now()
    FROM jsonb_to_recordset(%(claims)s::jsonb) AS d(id bigint, version bigint, result jsonb)
    WHERE j.id = d.id AND j.status IS NOT DISTINCT FROM 'running'
      AND j.claim_version = d.version
    RETURNING j.id, j.key, j.effect, j.claim_version, j.fingerprint, d.result
), {recorded}, parents AS (
    -- jobs waiting on these (after=[...]) count them done (fragment after_released)
    SELECT f.key, 'done'::text AS outcome, NULL::text AS error FROM finished f
), {after_released}
SELECT f.id FROM finished f;

-- ---------------------------------------------------------------------------------------
-- Delete on done (retention = 0): no done rows are kept, so completion deletes the job.
-- ---------------------------------------------------------------------------------------

-- name: complete_delete
-- running -> gone and the ledger row, in one statement and so in one transaction; fenced
-- exactly like complete, so a stale claim deletes nothing and writes no ledger row. A
-- delete adds no index entries where the done update adds one to every index of the
-- table, and leaves no row for retention to delete later. Enqueue dedup then rests on
-- the ledger row alone, which recorded_claims reads too.
WITH finished AS (
    DELETE FROM {schema}.jobs j
    USING jsonb_to_recordset(%(claims)s::jsonb) AS d(id bigint, version bigint, result jsonb)
    WHERE j.id = d.id AND j.status IS NOT DISTINCT FROM 'running'
      AND j.claim_version = d.version
    RETURNING j.id, j.key, j.effect, j.claim_version, j.fingerprint, d.result, j.after_failed
), {recorded}, parents AS (
    -- jobs waiting on these (after=[...]) count them done (fragment after_released)
    SELECT f.key, 'done'::text AS outcome, NULL::text AS error FROM finished f
), {after_released}, unlinked AS (
    -- A deleted job's own edges (it waited on parents) go with it: looked for by the
    -- primary key, and only for jobs that had parents (after_failed is set), so none is
    -- looked for while after=[...] is unused.
    DELETE FROM {schema}.after_edges e
    WHERE e.child_id = ANY (ARRAY(SELECT f.id FROM finished f
                                  WHERE f.after_failed IS NOT NULL))
)
SELECT f.id FROM finished f;

-- name: recorded_claims
-- Which of these claims already completed: after a lost reply, tells "my own done
-- landed" apart from "my claim was lost".
SELECT r.job_id
FROM {schema}.effect_results r
JOIN jsonb_to_recordset(%(claims)s::jsonb) AS c(id bigint, version bigint)
  ON r.job_id = c.id AND r.claim_version = c.version;

-- name: settle
-- running -> pending (retry, or release with the attempt refunded), failed or reconcile:
-- the decisions of outbox._lifecycle (settle, and expired for the rescuer's). A claim the
-- rescuer found expired (expired: true) is also fenced on its lease still being expired,
-- so a heartbeat that commits first wins.
-- Each claim carries two decisions taken up front (outbox._dispatch.settling): its own,
-- and the one for a claim an operator cancelled (cancel_version) before this write
-- (outbox._lifecycle.cancelled_meanwhile, the cancelled_* fields); the statement picks
-- one by what it reads, with no rule of its own, and answers which it wrote: per job
-- settled, its id and cancelled (true: the cancelled_* decision), so that what is
-- reported (the recorder's counts, events and spans) is what was written. The id comes
-- first: a reader of the ids alone (the rescuer's, scalar) takes the first column.
-- A job failed for good settles the jobs waiting on it (fragment after_released).
WITH settled AS (
UPDATE {schema}.jobs j
SET status = CASE WHEN j.cancel_version = j.claim_version
                  THEN s.cancelled_status ELSE s.status END,
    attempts = j.attempts - CASE WHEN (CASE WHEN j.cancel_version = j.claim_version
                                            THEN s.cancelled_refund ELSE s.refund END)
                                 THEN 1 ELSE 0 END,
    available_at = CASE WHEN j.cancel_version = j.claim_version
                        THEN CASE WHEN s.cancelled_status = 'pending'
                                  THEN now() + s.cancelled_delay * interval '1 second'
                                  ELSE j.available_at END
                        WHEN s.status = 'pending'
                        THEN now() + s.delay * interval '1 second'
                        ELSE j.available_at END,
    last_error = coalesce(CASE WHEN j.cancel_version = j.claim_version
                               THEN s.cancelled_error ELSE s.error END, j.last_error),
    lease_until = NULL,
    claimed_by = NULL,
    updated_at = now()
FROM jsonb_to_recordset(%(claims)s::jsonb)
     AS s(id bigint, version bigint, status text, delay float8, error text, refund boolean,
          expired boolean, cancelled_status text, cancelled_delay float8,
          cancelled_error text, cancelled_refund boolean)
WHERE j.id = s.id AND j.status IS NOT DISTINCT FROM 'running'
  AND j.claim_version = s.version
  AND (s.expired IS NOT TRUE OR j.lease_until < now())
RETURNING j.id, j.key, j.status, j.last_error,
          (j.cancel_version = j.claim_version) IS TRUE AS cancelled
), parents AS (
    SELECT t.key, 'failed'::text AS outcome, t.last_error AS error
    FROM settled t WHERE t.status = 'failed'
), {after_released}
SELECT t.id, t.cancelled FROM settled t;

-- name: rescue
-- Claims whose lease expired (the worker died or stalled), oldest first, with what the
-- rescuer's decision (outbox._lifecycle.expired: an unknown outcome, settled as one)
-- reads, and the database's clock to decide with. Rows another session has locked (a
-- heartbeat or an outcome being written) are skipped. Nothing is written here: the
-- decisions are applied by settle, fenced on the claim_version read here and on the
-- lease still being expired, so a heartbeat or an outcome that commits first wins.
SELECT j.id, j.effect, j.key, j.attempts, j.claim_version, j.ordering_key, j.max_attempts,
       j.first_attempted_at, j.claimed_by, j.group_key, j.priority, j.scheduled_for,
       j.cancel_version IS NOT DISTINCT FROM j.claim_version AS cancelled, now() AS now
FROM {schema}.jobs j
WHERE j.status = 'running' AND j.lease_until < now()
ORDER BY j.lease_until
LIMIT %(limit)s
FOR UPDATE SKIP LOCKED;

-- name: rescued_payloads
-- The payloads of the rescued jobs whose on_failed hook runs (a Job carries its payload).
SELECT j.id, CAST(j.payload AS text) AS payload
FROM {schema}.jobs j
WHERE j.id = ANY(%(ids)s::bigint[]);
