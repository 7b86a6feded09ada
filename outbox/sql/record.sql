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
-- Nor do they join their batch with jobs: on such statistics (few jobs, none running)
-- the planner counted on about one running job and read the whole batch again for each
-- running job, a nested loop comparing 4,000,000 pairs for a batch of 2,000 (30 times
-- a hash join's time), in custom and generic plans alike. With no join there is no plan
-- to choose: the batch is read once (fragment claims); the jobs are found by their ids
-- as the primary key's index condition (an array, evaluated once), each fenced on its
-- claim by a lookup in an object built once (fragment claimed), and a job's own claim
-- read the same way (fragment claim_of).

-- fragment: claims
-- The batch %(claims)s, a JSON array of {id, version, ...} objects (one parameter,
-- parsed by the server, whatever the batch size), read once, as one row: its jobs' ids;
-- by_claim, each claim's place in the batch under the key "<id>/<version>" (jsonb keeps
-- an object's keys sorted: a lookup is a binary search); expired, the keys of the claims
-- marked expired (settle's, the rescuer's), NULL when none is; batch, the array itself.
-- A job claimed at two versions has two keys (an outcome of its former claim may wait
-- while it is claimed again); of two equal claims the later is kept.
claims AS (
    SELECT array_agg(c.id) AS ids,
           jsonb_object_agg(concat(c.id, '/', c.version), c.place - 1) AS by_claim,
           jsonb_object_agg(concat(c.id, '/', c.version), true) FILTER (WHERE c.expired)
               AS expired,
           %(claims)s::jsonb AS batch
    FROM ROWS FROM (jsonb_to_recordset(%(claims)s::jsonb)
                    AS (id bigint, version bigint, expired boolean))
         WITH ORDINALITY AS c(id, version, expired, place)
)

-- fragment: claimed
-- Job j is one of the batch's (fragment claims) at its claim_version: found by the
-- primary key (the ids, an initplan, as its index condition), then fenced on the version
-- by a lookup of "<id>/<claim_version>" (both subqueries uncorrelated: evaluated once).
j.id = ANY (CAST((SELECT c.ids FROM claims c) AS bigint[]))
AND (SELECT c.by_claim FROM claims c) ? concat(j.id, '/', j.claim_version)

-- fragment: claim_of
-- The claim of job j in the batch (fragment claims) at its claim_version, or NULL: one
-- lookup and the batch's element at that place.
((SELECT c.batch FROM claims c)
 -> ((SELECT c.by_claim FROM claims c) ->> concat(j.id, '/', j.claim_version))::int)

-- name: heartbeat
-- Extend the leases of the claims this worker still holds; ids missing from the result
-- are claims it has lost; cancel says an operator asked this claim to stop (outbox
-- cancel: the fallback of its notification). The claims: {id, version} (fragment claims).
WITH {claims}
UPDATE {schema}.jobs j
SET lease_until = now() + %(lease)s::float8 * interval '1 second'
WHERE {claimed} AND j.status IS NOT DISTINCT FROM 'running'
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
-- running -> done and the ledger row, in one statement and so in one transaction. The
-- claims: {id, version, result} (fragment claims; a result JSON null is written NULL).
WITH {claims}, finished AS (
    UPDATE {schema}.jobs j
    SET status = 'done', lease_until = NULL, claimed_by = NULL, last_error = NULL,
        updated_at = now()
    WHERE {claimed} AND j.status IS NOT DISTINCT FROM 'running'
    RETURNING j.id, j.key, j.effect, j.claim_version, j.fingerprint,
              nullif({claim_of} -> 'result', 'null') AS result
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
-- the ledger row alone, which recorded_claims reads too. The claims: as complete's.
WITH {claims}, finished AS (
    DELETE FROM {schema}.jobs j
    WHERE {claimed} AND j.status IS NOT DISTINCT FROM 'running'
    RETURNING j.id, j.key, j.effect, j.claim_version, j.fingerprint,
              nullif({claim_of} -> 'result', 'null') AS result, j.after_failed
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
-- landed" apart from "my claim was lost". The claims: {id, version, key}, the job's key
-- with each (their own batch, not fragment claims, which reads no keys). A completion's
-- ledger row holds its job's key, id and claim version: found by the ledger's primary key
-- (the keys, an initplan, as its index condition), then fenced on the claim by a lookup
-- of "<id>/<claim_version>" as the fenced writes are (no join: no plan to choose).
WITH claims AS (
    SELECT array_agg(c.key) AS keys,
           jsonb_object_agg(concat(c.id, '/', c.version), true) AS by_claim
    FROM jsonb_to_recordset(%(claims)s::jsonb) AS c(id bigint, version bigint, key text)
)
SELECT r.job_id
FROM {schema}.effect_results r
WHERE r.key = ANY (CAST((SELECT c.keys FROM claims c) AS text[]))
  AND (SELECT c.by_claim FROM claims c) ? concat(r.job_id, '/', r.claim_version);

-- name: lock_claims
-- Lock the jobs of these claims that still hold their fence (running at the claim's
-- version), before their completion hooks are called and before their status changes
-- (outbox/_dispatch/hooked.py, ``locked``): a claim lost meanwhile is not locked, and its
-- hook is not called; a locked job cannot be claimed again, rescued or cancelled until
-- this transaction ends, so the completion written after the hooks finds every one. The
-- ids of the jobs locked. The claims: {id, version} (fragment claims).
WITH {claims}
SELECT j.id
FROM {schema}.jobs j
WHERE {claimed} AND j.status IS NOT DISTINCT FROM 'running'
FOR UPDATE OF j;

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
-- The claims: {id, version, status, delay, error, refund, expired, cancelled_status,
-- cancelled_delay, cancelled_error, cancelled_refund} (fragment claims). A job's claim
-- is looked up once (the subquery of its new values, s) and its fields read from it.
-- A job failed for good settles the jobs waiting on it (fragment after_released).
WITH {claims}, settled AS (
UPDATE {schema}.jobs j
SET (status, attempts, available_at, last_error) = (
        SELECT CASE WHEN j.cancel_version = j.claim_version
                    THEN s.claim ->> 'cancelled_status' ELSE s.claim ->> 'status' END,
               j.attempts - CASE WHEN (CASE WHEN j.cancel_version = j.claim_version
                                            THEN s.claim ->> 'cancelled_refund'
                                            ELSE s.claim ->> 'refund' END)::boolean
                                 THEN 1 ELSE 0 END,
               CASE WHEN j.cancel_version = j.claim_version
                    THEN CASE WHEN s.claim ->> 'cancelled_status' = 'pending'
                              THEN now() + (s.claim ->> 'cancelled_delay')::float8
                                           * interval '1 second'
                              ELSE j.available_at END
                    WHEN s.claim ->> 'status' = 'pending'
                    THEN now() + (s.claim ->> 'delay')::float8 * interval '1 second'
                    ELSE j.available_at END,
               coalesce(CASE WHEN j.cancel_version = j.claim_version
                             THEN s.claim ->> 'cancelled_error'
                             ELSE s.claim ->> 'error' END, j.last_error)
        -- OFFSET 0 keeps the lookup in its own subquery: pulled up, it would be made
        -- again for every field read.
        FROM (SELECT {claim_of} AS claim OFFSET 0) s),
    lease_until = NULL,
    claimed_by = NULL,
    updated_at = now()
WHERE {claimed} AND j.status IS NOT DISTINCT FROM 'running'
  -- a claim marked expired only while its lease still is (none is marked: no lookup)
  AND ((SELECT c.expired FROM claims c) IS NULL
       OR NOT (SELECT c.expired FROM claims c) ? concat(j.id, '/', j.claim_version)
       OR j.lease_until < now())
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
