-- Every statement outbox runs, as named blocks. {schema} is replaced by the quoted schema
-- identifier when the block is loaded (psycopg.sql.Identifier); values are always bound
-- parameters, by name. Each state transition is one guarded statement: a write about a
-- claimed job is conditional on status = 'running' AND claim_version = the claim's
-- version, so a stale worker's write changes 0 rows.

-- Enqueue: the blocks every transaction kind runs (psycopg, SQLAlchemy, Django), the
-- inbox's receive too. SQLAlchemy's text() reads ":key::text" as a parameter named "ke",
-- so their parameters are cast with CAST(... AS ...), never with "::".

-- name: enqueue
-- Insert one job unless its key is already a job or a ledger row. The notify wakes idle
-- dispatchers when the transaction commits (PostgreSQL folds repeats into one).
WITH inserted AS (
    INSERT INTO {schema}.jobs (effect, key, payload, fingerprint, available_at, ordering_key, max_attempts,
                               trace_context)
    SELECT CAST(%(effect)s AS text), CAST(%(key)s AS text), CAST(%(payload)s AS jsonb),
           CAST(%(fingerprint)s AS text), coalesce(CAST(%(run_at)s AS timestamptz), now()),
           CAST(%(ordering_key)s AS text), CAST(%(max_attempts)s AS integer),
           CAST(%(trace_context)s AS jsonb)
    WHERE NOT EXISTS (SELECT 1 FROM {schema}.effect_results r WHERE r.key = CAST(%(key)s AS text))
    ON CONFLICT (key) DO NOTHING
    RETURNING id
)
SELECT i.id, true AS created, NULL::text AS effect, NULL::text AS fingerprint
FROM inserted i, pg_notify(CAST(%(channel)s AS text), '')
UNION ALL
SELECT j.id, false, j.effect, j.fingerprint
FROM {schema}.jobs j
WHERE j.key = CAST(%(key)s AS text) AND NOT EXISTS (SELECT 1 FROM inserted)
UNION ALL
SELECT NULL, false, r.effect, r.fingerprint
FROM {schema}.effect_results r
WHERE r.key = CAST(%(key)s AS text) AND NOT EXISTS (SELECT 1 FROM inserted);

-- name: enqueue_many
-- The bulk path: one statement for any number of jobs, created ids out. The jobs arrive
-- as one JSON array (each payload already canonical JSON, embedded as is): one
-- parameter, parsed by the server, however many jobs. The batch shares one enqueue span,
-- so one trace context (NULL when tracing is off).
WITH wanted AS (
    SELECT *
    FROM ROWS FROM (jsonb_to_recordset(CAST(%(jobs)s AS jsonb))
                    AS (effect text, key text, payload jsonb, fingerprint text,
                        run_at timestamptz, ordering_key text, max_attempts integer))
         WITH ORDINALITY
         AS w(effect, key, payload, fingerprint, run_at, ordering_key, max_attempts, ord)
), inserted AS (
    INSERT INTO {schema}.jobs (effect, key, payload, fingerprint, available_at, ordering_key, max_attempts,
                               trace_context)
    SELECT w.effect, w.key, w.payload, w.fingerprint, coalesce(w.run_at, now()), w.ordering_key, w.max_attempts,
           CAST(%(trace_context)s AS jsonb)
    FROM wanted w
    WHERE NOT EXISTS (SELECT 1 FROM {schema}.effect_results r WHERE r.key = w.key)
    ORDER BY w.ord
    ON CONFLICT (key) DO NOTHING
    RETURNING id, key
)
SELECT i.key, i.id FROM inserted i
UNION ALL
SELECT NULL, NULL FROM (SELECT 1 FROM inserted LIMIT 1) AS any_inserted, pg_notify(CAST(%(channel)s AS text), '');

-- name: lookup_keys
-- What already holds each key: a job (id, effect, fingerprint) or only the ledger.
SELECT k.key, j.id, coalesce(j.effect, r.effect) AS effect,
       coalesce(j.fingerprint, r.fingerprint) AS fingerprint
FROM unnest(CAST(%(keys)s AS text[])) AS k(key)
LEFT JOIN {schema}.jobs j ON j.key = k.key
LEFT JOIN {schema}.effect_results r ON r.key = k.key;

-- name: claim
-- Claim up to %(limit)s due jobs. The locking clause sits inside the CTE (it does not
-- reach into a WITH from outside) and the UPDATE repeats status = 'pending': EvalPlanQual
-- rechecks only the UPDATE's own conditions, so without the guard a session that waited
-- on a row another session just claimed would claim it too. A job with an ordering key
-- is claimable only when no earlier job of that key is unfinished and none is running.
-- The ids go through an array so the UPDATE probes the primary key instead of letting
-- the planner hash-join against every pending row.
WITH candidates AS (
    SELECT j.id
    FROM {schema}.jobs j
    WHERE j.status = 'pending'
      AND j.available_at <= now()
      AND j.effect = ANY(%(effects)s::text[])
      AND (j.ordering_key IS NULL OR NOT EXISTS (
            SELECT 1 FROM {schema}.jobs o
            WHERE o.ordering_key = j.ordering_key
              AND o.id <> j.id
              AND (o.status = 'running' OR (o.status = 'pending' AND o.id < j.id))))
    ORDER BY j.available_at, j.id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE {schema}.jobs j
SET status = 'running',
    attempts = j.attempts + 1,
    claim_version = j.claim_version + 1,
    lease_until = now() + %(lease)s::float8 * interval '1 second',
    claimed_by = %(worker)s::text,
    first_attempted_at = coalesce(j.first_attempted_at, now()),
    updated_at = now()
WHERE j.id = ANY (ARRAY(SELECT id FROM candidates)) AND j.status = 'pending'
-- The payload as text: json.loads on a str costs a fraction of psycopg's jsonb loader,
-- and a claim decodes thousands of them.
RETURNING j.id, j.effect, j.key, j.payload::text, j.attempts, j.claim_version, j.ordering_key,
          j.max_attempts, j.first_attempted_at,
          -- how long the job had been due: the queue wait reported to observers
          -- (date_part gives float8 directly; extract() would compute a numeric)
          greatest(date_part('epoch', now() - j.available_at), 0) AS waited,
          -- the enqueue's span, for the attempt's span to link to (NULL when not traced)
          j.trace_context,
          -- the provider's answer kept after a completion hook raised: reused, not re-performed
          CAST(j.performed_result AS text) AS performed_result;

-- name: heartbeat
-- Extend the leases of the claims this worker still holds; ids missing from the result
-- are claims it has lost. Batches arrive as one JSON array of {id, version, ...}
-- objects: one parameter, parsed by the server, whatever the batch size.
UPDATE {schema}.jobs j
SET lease_until = now() + %(lease)s::float8 * interval '1 second'
FROM jsonb_to_recordset(%(claims)s::jsonb) AS h(id bigint, version bigint)
WHERE j.id = h.id AND j.status = 'running' AND j.claim_version = h.version
RETURNING j.id;

-- name: complete
-- running -> done and the ledger row, in one statement and so in one transaction.
WITH finished AS (
    UPDATE {schema}.jobs j
    SET status = 'done', lease_until = NULL, claimed_by = NULL, last_error = NULL,
        updated_at = now()
    FROM jsonb_to_recordset(%(claims)s::jsonb) AS d(id bigint, version bigint, result jsonb)
    WHERE j.id = d.id AND j.status = 'running' AND j.claim_version = d.version
    RETURNING j.id, j.key, j.effect, j.claim_version, j.fingerprint, d.result
), recorded AS (
    INSERT INTO {schema}.effect_results (key, effect, job_id, claim_version, result, fingerprint)
    SELECT f.key, f.effect, f.id, f.claim_version, f.result, f.fingerprint FROM finished f
    ON CONFLICT (key) DO NOTHING
)
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
    WHERE j.id = d.id AND j.status = 'running' AND j.claim_version = d.version
    RETURNING j.id, j.key, j.effect, j.claim_version, j.fingerprint, d.result
), recorded AS (
    INSERT INTO {schema}.effect_results (key, effect, job_id, claim_version, result, fingerprint)
    SELECT f.key, f.effect, f.id, f.claim_version, f.result, f.fingerprint FROM finished f
    ON CONFLICT (key) DO NOTHING
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
-- running -> pending (retry, or release with the attempt refunded), failed or reconcile.
UPDATE {schema}.jobs j
SET status = s.status,
    attempts = j.attempts - CASE WHEN s.refund THEN 1 ELSE 0 END,
    available_at = CASE WHEN s.status = 'pending'
                        THEN now() + s.delay * interval '1 second'
                        ELSE j.available_at END,
    last_error = coalesce(s.error, j.last_error),
    lease_until = NULL,
    claimed_by = NULL,
    updated_at = now()
FROM jsonb_to_recordset(%(claims)s::jsonb)
     AS s(id bigint, version bigint, status text, delay float8, error text, refund boolean)
WHERE j.id = s.id AND j.status = 'running' AND j.claim_version = s.version
RETURNING j.id;

-- name: rescue
-- Take back claims whose lease expired (the worker died or stalled). Fenced on the
-- version read under lock and rechecked on the UPDATE, so a heartbeat that commits
-- first wins. The attempt already counted; past the provider's idempotency window an
-- unknown outcome cannot be retried safely, so such a job goes to reconcile. The window
-- is per effect where the effect declares one (%(windows)s, a JSON object effect ->
-- seconds), else %(unknown_window)s.
WITH expired AS (
    SELECT id, claim_version
    FROM {schema}.jobs
    WHERE status = 'running' AND lease_until < now()
    ORDER BY lease_until
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE {schema}.jobs j
SET status = CASE
        WHEN j.first_attempted_at < now() - coalesce(
                CAST(CAST(%(windows)s AS jsonb) ->> j.effect AS float8),
                CAST(%(unknown_window)s AS float8)) * interval '1 second'
            THEN 'reconcile'
        WHEN j.attempts >= j.max_attempts THEN 'failed'
        ELSE 'pending' END,
    last_error = 'lease expired on attempt ' || j.attempts || ' of ' || j.max_attempts
                 || ' (worker ' || j.claimed_by || ' stopped heartbeating)',
    available_at = now(),
    lease_until = NULL,
    claimed_by = NULL,
    updated_at = now()
FROM expired e
WHERE j.id = e.id AND j.status = 'running' AND j.claim_version = e.claim_version
  AND j.lease_until < now()
RETURNING j.id, j.key, j.status, j.claim_version;

-- name: has_due_work
-- Whether this dispatcher may still have work: a claimable job, or a running job of its
-- effects (another worker's, which may fail back to pending or be rescued if its lease
-- expires).
SELECT EXISTS (
    SELECT 1 FROM {schema}.jobs j
    WHERE j.status = 'pending'
      AND j.available_at <= now()
      AND j.effect = ANY(%(effects)s::text[])
      AND (j.ordering_key IS NULL OR NOT EXISTS (
            SELECT 1 FROM {schema}.jobs o
            WHERE o.ordering_key = j.ordering_key
              AND o.id <> j.id
              AND (o.status = 'running' OR (o.status = 'pending' AND o.id < j.id))))
) OR EXISTS (
    SELECT 1 FROM {schema}.jobs j
    WHERE j.status = 'running' AND j.effect = ANY(%(effects)s::text[])
);

-- name: purge_done
-- Retention: delete done jobs older than %(age)s seconds, a batch at a time.
WITH doomed AS (
    SELECT id FROM {schema}.jobs
    WHERE status = 'done' AND updated_at < now() - %(age)s::float8 * interval '1 second'
    ORDER BY updated_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
DELETE FROM {schema}.jobs j USING doomed d
WHERE j.id = d.id AND j.status = 'done';

-- name: purge_ledger
-- Retention of the ledger, on its own (longer) period.
WITH doomed AS (
    SELECT key FROM {schema}.effect_results
    WHERE recorded_at < now() - %(age)s::float8 * interval '1 second'
    ORDER BY recorded_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
DELETE FROM {schema}.effect_results r USING doomed d
WHERE r.key = d.key;

-- name: retry_job
-- Operator retry: failed or reconcile -> pending, with a fresh attempt budget and a fresh
-- idempotency window. claim_version keeps growing.
UPDATE {schema}.jobs
SET status = 'pending', attempts = 0, available_at = now(), first_attempted_at = NULL,
    updated_at = now()
WHERE id = %(id)s::bigint AND status IN ('failed', 'reconcile')
RETURNING id, key, effect;

-- name: job_status
SELECT status FROM {schema}.jobs WHERE id = %(id)s::bigint;

-- name: status_counts
SELECT status, count(*) AS jobs FROM {schema}.jobs GROUP BY status ORDER BY status;

-- name: queue_health
SELECT
    (SELECT extract(epoch FROM now() - min(available_at))
       FROM {schema}.jobs WHERE status = 'pending' AND available_at <= now()) AS oldest_pending_age,
    (SELECT count(*) FROM {schema}.jobs
      WHERE status = 'pending' AND available_at <= now()) AS due_backlog,
    (SELECT count(*) FROM {schema}.jobs
      WHERE status = 'running' AND lease_until < now()) AS expired_leases,
    (SELECT n_dead_tup FROM pg_stat_user_tables
      WHERE schemaname = %(schema_name)s::text AND relname = 'jobs') AS dead_tuples;

-- name: recent_failures
SELECT id, effect, key, status, attempts, last_error, updated_at
FROM {schema}.jobs
WHERE status IN ('failed', 'reconcile')
ORDER BY updated_at DESC, id DESC
LIMIT %(limit)s;

-- ---------------------------------------------------------------------------------------
-- Test kit readers (outbox.testing): what a test asserts on, so users write no SQL.
-- ---------------------------------------------------------------------------------------

-- name: testkit_jobs
-- Every job, oldest first; narrowed to one effect and/or one key when those are given.
SELECT * FROM {schema}.jobs
WHERE (%(effect)s::text IS NULL OR effect = %(effect)s::text)
  AND (%(key)s::text IS NULL OR key = %(key)s::text)
ORDER BY id;

-- name: testkit_ledger
-- Every ledger row, oldest first; narrowed to one key when it is given.
SELECT * FROM {schema}.effect_results
WHERE %(key)s::text IS NULL OR key = %(key)s::text
ORDER BY recorded_at, key;

-- Inbox: the idempotent consumer's record of the messages it handled.

-- name: receive
-- Record a message in the caller's transaction; a row comes back only the first time.
-- A concurrent insert of the same message waits for the other transaction and then
-- conflicts (no row) if it committed, or inserts (a row) if it rolled back.
INSERT INTO {schema}.inbox (consumer, message_id)
VALUES (CAST(%(consumer)s AS text), CAST(%(message_id)s AS text))
ON CONFLICT (consumer, message_id) DO NOTHING
RETURNING true AS first;

-- name: receive_many
-- receive for many messages in one statement; the ids that come back were recorded now
-- (first time), the others had been received before. Waits on concurrent receives as
-- receive does.
INSERT INTO {schema}.inbox (consumer, message_id)
SELECT CAST(%(consumer)s AS text), m
FROM unnest(CAST(%(message_ids)s AS text[])) AS m
ON CONFLICT (consumer, message_id) DO NOTHING
RETURNING message_id;

-- name: purge_inbox
-- Retention of the inbox: delete rows received more than %(age)s seconds ago, at most
-- %(limit)s per call (repeat while it deletes %(limit)s). A repeat arriving after its row
-- is purged counts as new: keep the retention longer than any redelivery can lag.
WITH doomed AS (
    SELECT consumer, message_id FROM {schema}.inbox
    WHERE received_at < now() - CAST(%(age)s AS float8) * interval '1 second'
    ORDER BY received_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
DELETE FROM {schema}.inbox i USING doomed d
WHERE i.consumer = d.consumer AND i.message_id = d.message_id;

-- name: jobs_in_transaction
-- Every job in enqueue order as the caller's transaction sees them: tests that run inside
-- a transaction which never commits (Django's TestCase) assert on what it enqueued.
SELECT id, effect, key, CAST(payload AS text) AS payload, status
FROM {schema}.jobs
ORDER BY id;

-- Flows: the provider's own word that a job was performed (outbox.flows).

-- name: resolve_by_event
-- An event from the provider says the job with this key was performed (a Stripe webhook
-- whose metadata carries the key). A job in reconcile, or pending between attempts, goes
-- (back) to pending with the provider's answer kept: the next claim records it without
-- performing, runs on_done and writes the ledger row, fenced like any completion. A
-- running job is left to its claim. Audited as the reconciler's decision.
WITH resolved AS (
    UPDATE {schema}.jobs j
    SET status = 'pending', performed_result = CAST(%(result)s AS jsonb), attempts = 0,
        available_at = now(), reconcile_at = NULL, reconcile_checks = 0,
        last_error = CAST(%(note)s AS text), updated_at = now()
    WHERE j.key = CAST(%(key)s AS text) AND j.status IN ('reconcile', 'pending')
      AND j.performed_result IS NULL
    RETURNING j.id
), audited AS (
    INSERT INTO {schema}.dashboard_audit (actor, action, job_id, detail, affected)
    SELECT 'reconciler', 'reconcile', r.id,
           jsonb_build_object('decision', 'performed', 'source', CAST(%(source)s AS text)), 1
    FROM resolved r
)
SELECT r.id FROM resolved r, pg_notify(CAST(%(channel)s AS text), '');

-- Kafka consumer offsets (effects.kafka.InboxConsumer).

-- name: kafka_offsets
-- The next offset to read of each partition of %(topics)s stored for a consumer group.
SELECT topic, partition, next_offset
FROM {schema}.kafka_offsets
WHERE consumer = %(consumer)s::text AND topic = ANY(%(topics)s::text[]);

-- name: store_kafka_offsets
-- In the caller's transaction: the next offsets to read, per topic and partition.
INSERT INTO {schema}.kafka_offsets (consumer, topic, partition, next_offset)
SELECT %(consumer)s::text, o.topic, o.partition, o.next_offset
FROM jsonb_to_recordset(%(offsets)s::jsonb) AS o(topic text, partition int, next_offset bigint)
ON CONFLICT (consumer, topic, partition)
DO UPDATE SET next_offset = EXCLUDED.next_offset, updated_at = now();

-- name: dispatcher_beat
-- A dispatcher's heartbeat: record (or refresh) which effects it serves, valid for
-- %(ttl)s seconds; forget dispatchers whose heartbeat stopped long ago.
WITH gone AS (
    DELETE FROM {schema}.dispatchers
    WHERE expires_at < now() - interval '1 hour' AND worker_id <> %(worker)s
)
INSERT INTO {schema}.dispatchers AS d (worker_id, effects, expires_at)
VALUES (%(worker)s, %(effects)s::text[], now() + CAST(%(ttl)s AS float8) * interval '1 second')
ON CONFLICT (worker_id) DO UPDATE
SET effects = EXCLUDED.effects, heartbeat_at = now(), expires_at = EXCLUDED.expires_at;

-- name: dispatcher_leave
-- A dispatcher that stops takes its row away at once.
DELETE FROM {schema}.dispatchers WHERE worker_id = %(worker)s;

-- name: unhandled_due
-- Due pending jobs of effects no live dispatcher serves, per effect: how many, and how
-- long the oldest has waited. Looks only at the %(limit)s oldest and the %(limit)s newest
-- due jobs (the claimable index, read from both ends), so the check stays cheap behind a
-- large backlog of served effects: jobs nobody claims grow oldest, and a fresh typo is
-- among the newest. The counts are exact up to 2 x %(limit)s due jobs.
WITH due AS (
    (SELECT id, effect, available_at FROM {schema}.jobs
     WHERE status = 'pending' AND available_at <= now()
     ORDER BY available_at, id
     LIMIT %(limit)s)
    UNION
    (SELECT id, effect, available_at FROM {schema}.jobs
     WHERE status = 'pending' AND available_at <= now()
     ORDER BY available_at DESC, id DESC
     LIMIT %(limit)s)
)
SELECT effect, count(*) AS due,
       extract(epoch FROM now() - min(available_at))::float8 AS oldest_age
FROM due
WHERE NOT EXISTS (SELECT 1 FROM {schema}.dispatchers d
                  WHERE d.expires_at > now() AND due.effect = ANY(d.effects))
GROUP BY effect
ORDER BY effect;

-- name: due_by_effect
-- The backlog per effect (outbox status): pending jobs, those due now, the oldest due
-- job's age, and how many live dispatchers serve the effect.
SELECT j.effect,
       count(*) AS pending,
       count(*) FILTER (WHERE j.available_at <= now()) AS due,
       extract(epoch FROM now() - min(j.available_at)
               FILTER (WHERE j.available_at <= now()))::float8 AS oldest_due_age,
       (SELECT count(*) FROM {schema}.dispatchers d
        WHERE d.expires_at > now() AND j.effect = ANY(d.effects)) AS dispatchers
FROM {schema}.jobs j
WHERE j.status = 'pending'
GROUP BY j.effect
ORDER BY j.effect;

-- name: live_dispatchers
-- The dispatchers whose heartbeat is current, with the effects each serves.
SELECT worker_id, effects, started_at,
       extract(epoch FROM now() - heartbeat_at)::float8 AS heartbeat_age
FROM {schema}.dispatchers
WHERE expires_at > now()
ORDER BY worker_id;
